# Two entry points (see README): `make repro` and `make test`; `make ui` browses the MLflow runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup repro check-repro exp-show ui test test-slow dashboard studies-status study-refresh gpu-kit clean-venv

setup: $(STAMP)

# torch is pinned first so that the CPU wheel (or an already installed build)
# satisfies torchvision's requirement instead of pulling a CUDA stack.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

repro: $(STAMP)
	test -d .dvc || $(VENV)/bin/dvc init -q
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/dvc repro
	@echo "Report: $(CURDIR)/report/report.md  (MLflow: make ui, then http://127.0.0.1:5000/#/experiments/1/runs?workflowType=machine_learning)"

# The MLflow UI on the project's store, at http://127.0.0.1:5000 (Ctrl-C stops it). The store records artifact
# locations as mlflow-artifacts:/... (docs/tracking.md), served from this folder's mlartifacts/, so a moved or
# copied project opens its own artifacts. No background job runners (MLflow's GenAI jobs, unused here).
ui: $(STAMP)
	@$(PY) -c "from fl_core.store.tracking import headline_url as h; u = h('fl-pipeline'); \
		print('runs table with the headline columns (final accuracy, algorithm, partition, seed): ' + u if u \
		else 'no runs in ./mlflow.db yet (make repro logs them)')"
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db \
		--artifacts-destination $(CURDIR)/mlartifacts --serve-artifacts --host 127.0.0.1 --port 5000

# the first screen of `dvc exp show` (docs/cli.md, Comparing runs): every experiment's final accuracy and only the
# params, metrics and code that differ between the rows; the rest of the headline numbers (final_std, best, worst10,
# rounds/uplink to target) are in report/metrics.json and `dvc exp show` without these flags.
EXP_SHOW := exp show --no-pager --only-changed --keep 'Created|final\.' --drop '.*_std\.|best|worst10|rounds_to_target|uplink_to_target'
exp-show: $(STAMP)
	$(VENV)/bin/dvc $(EXP_SHOW)

# after `make repro`: the fresh metrics against the committed ones (tolerance: docs/reliability.md)
check-repro: $(STAMP)
	$(PY) -m pipeline.check_repro

# lint (ruff) and the import contract (import-linter, pyproject.toml) first: seconds, before the suite.
# The suite runs on every core (pytest-xdist, -n auto; each test pins torch to one thread, tests/conftest.py).
# The end-to-end tests marked slow (DVC pipeline, kill campaigns, torchrun, PostgreSQL, the composition check) run
# in `make test-slow`; CI (.ci/run) runs both.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q -n auto -m "not slow" --durations=25

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow --durations=25

# optuna-dashboard on a sweep's storage, on this machine only (127.0.0.1): sweeps/studies/$(STUDY).log, the journal
# sweeps/tune.py writes by default (without STUDY: the only journal there), or STORAGE=<journal file | RDB URL>.
# A storage that does not exist yet is not created: one line says to run a sweep first (docs/sweeps.md, Dashboard).
STUDY   ?=
STORAGE ?=
PORT    ?= 8080
dashboard: $(STAMP)
	@$(PY) -m sweeps.dashboard $(if $(STORAGE),--storage '$(STORAGE)',$(if $(STUDY),--study '$(STUDY)')) \
		--host 127.0.0.1 --port $(PORT)

# the paper studies (studies/<s>/): which are stale against the code (dvc status), their last measured refresh
# (studies/refresh_times.csv) and whether their report is committed; study-refresh runs one study's dvc repro, timed
studies-status: $(STAMP)
	@$(PY) -m pipeline.studies_status $(if $(VERIFY),--verify) $(STUDY)

study-refresh: $(STAMP)
	@test -n "$(STUDY)" || { echo "error: name the study: make study-refresh STUDY=fedbug" >&2; exit 2; }
	$(PY) -m pipeline.studies_status --refresh $(STUDY)

# the wheels benchmarks/gpu_check.py installs on a GPU machine that has torch but no package index (hydra-core,
# omegaconf, antlr4 runtime; pure Python, for Python 3.12): gpu-kit/, git-ignored (docs/benchmarks.md, GPU)
gpu-kit: $(STAMP)
	$(PY) benchmarks/gpu_kit.py --out gpu-kit

clean-venv:
	rm -rf $(VENV)
