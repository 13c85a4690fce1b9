"""`offload-tuner serve`: the JSON API (the CLI's --json contract over HTTP) and a web view of studies.

Modules, one idea each: config (what the server was started with), security (bind, token, paths, sizes),
options (a JSON body -> the CLI's own argument parser), studies (reading Optuna storages), jobs (tune workers
in subprocesses), app (the routes), views (the HTML pages); static/ holds the vendored chart library.
"""
