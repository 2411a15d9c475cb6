"""The scheduler: which requests run in the next forward pass.

Admission, continuous batching, and the bookkeeping that hands pages to requests and takes them
back. Where a request's tokens live (the page table) is KV-cache state, in ``minisgl.kvcache``.
"""
