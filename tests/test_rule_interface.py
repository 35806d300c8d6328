"""The rule interface (fl_core/algorithms/base.py): its hooks, the wrappers' forwarding, descriptions, transforms."""

from __future__ import annotations

import pytest

from fl_core.algorithms import registry
from fl_core.algorithms.base import FORWARDED, HOOKS, Algorithm, Description, Needs, Wrapper
from fl_core.config import ConfigError, compose


def test_the_hook_count_is_what_base_documents():
    import fl_core.algorithms.base as base

    assert len(HOOKS) == 9 and "nine hooks" in base.__doc__
    for hook in HOOKS:
        assert f"``{hook}" in base.__doc__, hook


def test_every_hook_is_forwarded_by_a_wrapper():
    class Recorder(Algorithm):
        def __getattribute__(self, name):
            if name in FORWARDED:
                return lambda *a, **kw: ("base", name)
            return super().__getattribute__(name)

    class Bare(Wrapper):
        name = "bare"

    w = Bare(Recorder())
    for hook in FORWARDED:
        assert getattr(Wrapper, hook) is not getattr(Algorithm, hook), hook
        assert getattr(w, hook)() == ("base", hook)


def test_needs_combine_through_wrappers():
    class Base(Algorithm):
        needs = Needs(full_gradient=True, forward_of=("global",))

    class Seq(Wrapper):
        own_needs = Needs(vectorizable=False, forward_of=("state:prev", "global"))

    n = Seq(Base()).needs
    assert n == Needs(full_gradient=True, anchor_gradient=False, forward_of=("global", "state:prev"),
                      vectorizable=False)
    assert not Seq(Base()).vectorizable


def test_description_text_and_structure():
    inner = Description("fedavg")
    d = Description("topk", (("", "0.1"), ("", "ef")), inner)
    assert d == "topk[0.1,ef](fedavg)" and str(Description("feddyn", (("alpha", "0.01"),))) == "feddyn[alpha=0.01]"
    assert d.to_dict() == {"name": "topk", "shown": [["", "0.1"], ["", "ef"]],
                           "inner": {"name": "fedavg", "shown": [], "inner": None}}
    import pickle

    assert pickle.loads(pickle.dumps(d)).to_dict() == d.to_dict()
    with pytest.raises(AttributeError):
        d.name = "x"


def test_a_transform_in_wrappers_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^algorithm.wrappers\[0\]=topk is a message transform: give it in "
                                          r"algorithm.transforms"):
        compose(["algorithm.wrappers=[topk]"])


def test_transforms_are_registered_as_their_own_kind():
    assert set(registry.names("transform")) >= {"topk", "qsgd"}
    assert not set(registry.names("transform")) & set(registry.names("wrapper"))
