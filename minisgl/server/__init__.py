"""The served engine's front door: the command line, the HTTP API and the launcher.

- ``args``: the command line; ``protocol`` and ``responses``: the OpenAI wire format, in and out;
- ``frontend``: the router between HTTP requests and the workers, which also ends a request
  before its last reply when it must; ``lifecycle``: the reply buffer and the client's
  disconnect;
- ``api_server``: the FastAPI app, its routes and its error answers, with ``streaming`` (SSE),
  ``metrics``, ``access_log`` and ``openapi`` beside it;
- ``launch``: starts the workers, serves HTTP (or the shell) and stops every worker on the way
  out.

Nothing is imported here, so ``import minisgl.server.args`` stays cheap. Chapters 15 and 16
tell the story.
"""
