"""What one round of the loop does, as one value passed down from the scheduler to the kernels."""

from __future__ import annotations

from enum import IntEnum, auto


class ForwardMode(IntEnum):
    """The kind of a forward round (names as in SGLang's ``forward_batch_info.py``).

    EXTEND: new prompt tokens (a whole prompt or one chunk of it) are appended to each request's KV.
    DECODE: every request appends exactly one token (the one sampled last round).
    MIXED: one EXTEND chunk and running DECODE rows share a single forward.
    TARGET_VERIFY: the target model scores K+1 draft positions per request (speculative decoding).
    DRAFT_EXTEND: the draft model catches up on accepted tokens (speculative decoding).
    """

    EXTEND = auto()
    DECODE = auto()
    MIXED = auto()
    TARGET_VERIFY = auto()
    DRAFT_EXTEND = auto()

    def is_extend(self) -> bool:
        """True for rounds whose rows may append more than one token (EXTEND, MIXED, DRAFT_EXTEND)."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY
