"""The protocol layer: what a client and an engine both must agree on, importable without torch.

The wire types (:mod:`.types`, :mod:`.sample_types`) and one typed request per op (:mod:`.requests`),
the errors an engine reports (:mod:`.errors`), the checks of wire fields and training batches that
run on both sides (:mod:`.wire_checks`, :mod:`.data_checks`), checkpoint addresses
(:mod:`.checkpoint_paths`), the loss table (:mod:`.loss_registry`), the client's side of each control
call (:mod:`.calls`), the price table an engine bills by and a forecast reads (:mod:`.prices`) and the
engine home's layout that the local launcher and the engine share (:mod:`.home`). It imports nothing
of sess above it: the SDK (``sdk/``) and the engine (``server/``, ``runtime/``, ``sampling/``) both
import it, never each other across it.
"""
