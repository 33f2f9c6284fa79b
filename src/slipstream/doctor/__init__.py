"""``slipstream doctor``: is every fast path correct on this machine, and what does it run?

- ``run_doctor``: the device (name, memory, compute capability, unified memory, a bounded
  pinned-memory probe; on a CPU its model, cores, RAM and bf16), the versions, the choice each
  fast path makes here and why (the library's own deciders), then a run of each fast path
  against its stock arm on a tiny random model of the requested family: parity of the loss and
  every gradient, host syncs, and a verdict (ok, WRONG, refused, skipped). Exit status 1 if any
  path is WRONG.
- ``first_use_hint``: the one line ``slipstream train`` / ``slipstream ab`` print while doctor has
  never passed on this device (a marker per device name and torch version in the cache).
"""

from .marker import first_use_hint, has_passed
from .models import DoctorError
from .report import run_doctor

__all__ = ["DoctorError", "first_use_hint", "has_passed", "run_doctor"]
