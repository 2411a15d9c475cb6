"""The scheduler: which requests run in the next forward pass, and where their tokens live.

Chapter 5 brings in ``table`` (the page table that maps each running request's tokens to slots
of the KV pool). Chapter 9 adds the scheduler itself: admission, continuous batching, and the
bookkeeping that hands pages to requests and takes them back.
"""
