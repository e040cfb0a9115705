"""The library internals the engine depends on, each behind one function of its own: torch's
(:mod:`.torch_internals`) and transformers' (:mod:`.transformers_internals`). Each function's
docstring names the public API that is missing; :data:`CHECKED` names the library versions they
were checked on, and a test fails on any other, so an upgrade is looked at here, in one place.
Product code calls these functions and never reaches into a library object's privates itself.
Below the sampling layer and the runtime; imports nothing of sess."""

# the versions every function of this package was checked on (the test of this package asserts
# the installed ones are these)
CHECKED = {"torch": "2.13.0", "transformers": "5.25.0", "peft": "0.21.2"}
