"""Constrained decoding: a grammar decides which tokens may come next (chapter 22).

- :mod:`~minisgl.grammar.automaton`: the idea at reading size, a small deterministic automaton
  and the allowed-token mask it gives over a vocabulary;
- :mod:`~minisgl.grammar.compile`: ``response_format`` and tool schemas turned into grammars of
  the library that replaces the automaton (llguidance), cached by schema;
- :mod:`~minisgl.grammar.states`: each request's matcher, and the bitmask that masks a batch's
  logits before sampling.
"""

from minisgl.grammar.compile import GrammarError, json_object_grammar, json_schema_grammar

__all__ = ["GrammarError", "json_object_grammar", "json_schema_grammar"]
