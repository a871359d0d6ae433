"""Which errors say nothing about the data being read: storage, network and memory failures.

A checkpoint or record whose read fails with one of these is not corrupt: it is read again
(records) or the run stops with it left as it is (checkpoints), never moved aside or skipped
as bad on the strength of it.
"""
import errno
import re

_ERRNOS = {errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR, errno.ENOMEM, errno.EMFILE,
           errno.ENFILE, errno.EIO, errno.ESTALE, errno.ECONNRESET, errno.ECONNREFUSED,
           errno.ECONNABORTED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN}
# absl status codes in TensorStore's, ArrayRecord's and XLA's messages, and their words.
_STATUS = re.compile(r"\b(UNAVAILABLE|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED|ABORTED|CANCELLED)"
                     r"\b|[Oo]ut of memory|[Tt]imed out")


def is_transient(e: BaseException | None) -> bool:
  """Whether `e`, or an error it was raised from, is a storage, network or memory failure."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, (MemoryError, TimeoutError, ConnectionError)) or (
        isinstance(e, OSError) and e.errno in _ERRNOS):
      return True
    if _STATUS.search(str(e)):
      return True
    e = e.__cause__ or e.__context__
  return False
