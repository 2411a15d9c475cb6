"""The messages the engine's processes send each other, and their serialization.

One request travels through four processes; each arrow is a ZMQ queue
(``minisgl.utils.queues``) carrying one family of messages::

    API server --TokenizeRequest, AbortRequest--> tokenizer
    tokenizer  --UserRequest, AbortRequest------> scheduler
    scheduler  --DetokenizeRequest--------------> detokenizer
    detokenizer --UserReply---------------------> API server

Modules are named for the process that *receives* their messages: ``tokenizer`` (both workers),
``backend`` (the scheduler), ``frontend`` (the API server); ``utils`` holds the serializer. A
request that fails ends with a :class:`RequestError` on its last message. Chapter 13 tells the
story; chapter 16 adds the errors.
"""

from __future__ import annotations

from minisgl.message.backend import BackendMessage, UserRequest
from minisgl.message.frontend import (
    FrontendMessage,
    RequestError,
    TokenUsage,
    UserReply,
    server_error,
)
from minisgl.message.tokenizer import (
    AbortRequest,
    DetokenizeRequest,
    DetokenizerMessage,
    TokenizeRequest,
    TokenizerMessage,
)
from minisgl.message.utils import (
    Message,
    SerializationError,
    dumps,
    loads,
    register_wire_type,
    registered_types,
)

__all__ = [
    "AbortRequest", "BackendMessage", "DetokenizeRequest", "DetokenizerMessage",
    "FrontendMessage", "Message", "RequestError", "SerializationError", "TokenUsage",
    "TokenizeRequest", "TokenizerMessage", "UserReply", "UserRequest", "dumps", "loads",
    "register_wire_type", "registered_types", "server_error",
]
