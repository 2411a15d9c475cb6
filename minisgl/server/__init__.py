"""The served engine's front door: the command line, the HTTP API and the launcher.

- ``args``: ``python -m minisgl``'s options (:func:`~minisgl.server.args.build_parser`) and the
  :class:`~minisgl.server.args.ServerArgs` they become;
- ``protocol``: the OpenAI wire format: the request bodies, the errors, the response bodies
  and the Server-Sent Events stream;
- ``frontend``: the :class:`~minisgl.server.frontend.RequestRouter` that sends each request
  to a tokenizer worker and hands every reply to the request it belongs to;
- ``lifecycle``: the :class:`~minisgl.server.lifecycle.LifecyclePolicy` that decides when a
  request ends before its last reply (a slow reader, a dead worker, shutdown), and the
  helpers that end requests when their HTTP client leaves;
- ``api_server``: the OpenAI-compatible HTTP API (FastAPI): the routes, built by
  :func:`~minisgl.server.api_server.create_app`;
- ``launch``: starts the worker processes, waits until each is ready, runs the HTTP server (or
  the interactive shell that ``python -m minisgl`` hands it, ``minisgl/shell.py``) and stops
  every worker on the way out.

Nothing is imported here, so ``import minisgl.server.args`` stays cheap.
"""
