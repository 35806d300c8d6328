"""Data: raw sources (:mod:`.sources`), client partitions (:mod:`.partition`) and
client sampling (:mod:`.sampling`); docs/algorithms.md, Data."""

from fl_core.data.partition import (
    Partition,
    PartitionError,
    get_partition,
    lognormal_sizes,
    make_partition,
    partition_key,
    plot_label_distribution,
)
from fl_core.data.sampling import expected_bernoulli_size, fixed_sample_size, sample_clients
from fl_core.data.sources import (
    SOURCES,
    DataSourceError,
    FLDataset,
    dataset_tag,
    describe_source,
    get_dataset,
    holdout_validation,
    load_source,
    prepared_path,
)

__all__ = [
    "SOURCES",
    "DataSourceError",
    "FLDataset",
    "dataset_tag",
    "describe_source",
    "get_dataset",
    "holdout_validation",
    "load_source",
    "prepared_path",
    "Partition",
    "PartitionError",
    "get_partition",
    "lognormal_sizes",
    "make_partition",
    "partition_key",
    "plot_label_distribution",
    "sample_clients",
    "expected_bernoulli_size",
    "fixed_sample_size",
]
