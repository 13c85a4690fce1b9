"""The autotuner: an Optuna study over the search space, measured on any Engine, screened by the memory model.

search (Tuner, the study's storage and settings), space (the knobs and placements a trial picks), objectives,
cost_fit (the cost model refitted to the runs), baselines (--fit, -cmoe, -ncmoe), confirm (re-measuring the
finalists), served (the finalists and --fit on llama-server), storage (study URLs and SQLite locks), report (the
study report). It imports only planner/: neither runtime/ (an engine comes in as an object) nor argparse (options
come in typed) nor the application above it; tests/test_import_graph.py holds it.
"""
