"""The engine's ops: the op table (:mod:`.table`: each op's request type, handler, scheduling and
what the executor, billing and the other ranks do around it), the executor's record of one op
(:mod:`.operation`), and the handlers, one module per area: sessions, training, sampling,
checkpoints."""
