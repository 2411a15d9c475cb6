"""The tokenizer and detokenizer workers.

- ``tokenize``: a request's prompt (text, chat messages or token ids) to token ids;
- ``detokenize``: a stream of tokens back to text, a piece per token, never splitting a
  character, and cut at the request's stop strings;
- ``server``: the two processes around them (:func:`run_tokenizer`, :func:`run_detokenizer`).

Nothing is imported here: a worker imports the module it runs. Chapter 14 tells the story.
"""
