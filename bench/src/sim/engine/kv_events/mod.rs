//! vLLM's KV cache events: the pool's changes as vLLM's msgpack batches (`kvevents`) and the
//! ZMQ PUB and replay sockets they go out on (`kvpublish`). Kept apart from the scheduler that
//! records them so the wire format can be checked byte for byte against vLLM's.

pub(super) mod kvevents;
pub(crate) mod kvpublish;
