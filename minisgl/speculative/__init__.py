"""Speculative decoding: cheap proposals checked by the target model in one pass (chapter 23).

``accept`` holds the verification rule (greedy, and the rejection sampling that keeps the
target's distribution exactly); ``ngram`` the prompt-lookup proposer, which needs no draft model.
"""
