"""Where runs are kept and how they survive: MLflow tracking (tracking.py, mlflow_artifacts.py), the experiment's
run store and completion records (runstore.py), durable files (durable.py), folders the project owns (owned.py), a
store's URI shown with its secrets masked (storeurl.py), bounded waits on a database (storewait.py), environment
failures in one line (envfail.py, storefail.py), processes (procs.py) and the named fault points that tests kill
at (faults.py). docs/reliability.md says what each guarantees."""
