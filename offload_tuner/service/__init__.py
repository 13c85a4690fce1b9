"""`offload-tuner serve`: the JSON API (the CLI's --json contract over HTTP) and a web view of studies.

Modules, one idea each: security (token, Host, paths, sizes), bodies (a JSON body -> the use case's request
dataclass, app/requests.py, and its OpenAPI schema), studies (reading Optuna storages), jobs (tune workers in
subprocesses), app (the routes), views (the HTML pages); static/ holds the vendored chart library. What the server
is started with is app/'s ServerConfig; the CLI starts it through app/serve.py, and nothing imports this package
but that.
"""
