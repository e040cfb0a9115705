"""Checkpoints: their files on disk, all safetensors + JSON (:mod:`.checkpoint_files`), each
directory's manifest of its owner and what it is (:mod:`.manifest`), and what their life needs from
the runtime: who may read one, copies, expiry, bytes on disk (:mod:`.checkpoint_lifecycle`). The ops
that save and load them are in :mod:`..ops.checkpoint_ops`."""
