"""The engines' one latency policy: what changes when a request is served alone.

Under load every hand-off between threads, processes and cores hides behind other work, and the engines optimise for
throughput. A request served alone pays for each hand-off in full: a sleeping thread that must wake (a few hundred
microseconds), an event loop asleep on an idle core that wakes slowly and runs slowly at first. So while a process
serves one request alone (`LatencyPolicy.alone`: its engine client has no other decode or submission in progress,
and has had none beside another for `QUIET_S`):

1. Decoding (front-end): a single JPEG of at most `INLINE_MAX_PIXELS`, before and after resizing, is decoded on the
   event loop rather than handed to the decoding threads (`decode_inline`), and the engine the request will go to is
   told to expect it (`expect`), so that engine's loop is turning when the frames arrive, for `EXPECT_S` at most.
2. Waiting (front-end): the reply is awaited by turning the event loop over rather than sleeping in it, while the
   request is alone and for `POLL_MAX_S` at most (`reply_poll`), so the reply is read the moment it lands, on a
   core still running at speed; other tasks of the loop still run at each turn.
3. Launching (engine): a pack of one item formed while nothing else is queued or running is launched from the
   batcher's loop rather than its forward thread, and its end is polled (`launch_inline`; CUDA only, where a launch
   is asynchronous: on the CPU the launch is the whole forward). A larger pack goes to the forward thread even on
   an idle GPU: its launch (an eager forward issues hundreds of kernels, milliseconds of host time) would hold the
   loop while submissions wait, and a thread's hand-off is small beside its forward.
4. Answering (engine): the result of a pack of one item, up to `INLINE_RESULT_BYTES`, is copied into its
   front-end's arena on the engine's event loop rather than by a copier thread (`copy_inline`). A pack's results
   land together, and copied on the loop one after another they would hold it for milliseconds (31 images of
   448 px: 25 MB) while the next pack's submissions wait to be read; the copier threads' copies let go of the
   interpreter lock.

Otherwise the decoding threads decode, the loops sleep until woken, and the forward thread launches. Nothing here
changes what is computed, only which thread does it and when it is noticed.

Why the quiet period: under load a front-end's requests spend much of their time outside the engine client (reading
bodies, writing replies), and one found alone between two others there would spin its loop and decode on it, while
its company waits for that loop; the more a front-end falls behind, the more often that happens. A process that has
just served two requests at once is under load, and serves none alone until `QUIET_S` has passed without company.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

from ..model.preprocess import Preprocessor, jpeg_size

# the largest JPEG (pixels, before and after resizing) a lone request decodes on the event loop: ~2 ms of decoding
INLINE_MAX_PIXELS = 640 * 640
# how long an idle engine keeps its loop turning after an `expect` when no submission follows
EXPECT_S = 0.01
# how long after two requests were last served at once a process serves none alone (the module's docstring)
QUIET_S = 0.5
# the largest result a lone pack copies on the engine's loop (4.): a 448 px image's merged tokens are 0.8 MB
INLINE_RESULT_BYTES = 1 << 20
# the longest a lone request's reply is polled for (2.): a lone 448 px image's forward takes a few milliseconds, and
# past this a wake-up's fraction of a millisecond is small beside the forward
POLL_MAX_S = 0.05


class LatencyPolicy:
    """The policy above for one process's engine client: it counts the decodes and submissions in progress
    (`busy`), and answers whether a request is alone and what that allows."""

    def __init__(self):
        self.in_progress = 0
        self.company_at = -QUIET_S  # (time.monotonic) when two were last in progress at once

    @contextlib.contextmanager
    def busy(self):
        """A request's decoding or submission, in progress for the block's duration."""
        self.in_progress += 1
        if self.in_progress > 1:
            self.company_at = time.monotonic()
        try:
            yield
        finally:
            self.in_progress -= 1

    def alone(self) -> bool:
        """Whether the caller's decoding or submission is the only one in progress in this process, and none has
        had company for `QUIET_S`."""
        return self.in_progress == 1 and time.monotonic() - self.company_at >= QUIET_S

    def reply_poll(self) -> Callable[[], bool]:
        """The condition a request's reply is polled under (2.): alone, for `POLL_MAX_S` from now at most."""
        until = time.monotonic() + POLL_MAX_S
        return lambda: self.alone() and time.monotonic() < until

    def decode_inline(self, pre: Preprocessor, inputs: list[bytes], min_pixels: int | None, max_pixels: int | None) -> bool:
        """Whether to decode `inputs` on the event loop (1.): a lone request's single small JPEG."""
        return len(inputs) == 1 and self.alone() and small_jpeg(pre, inputs[0], min_pixels, max_pixels)

    @staticmethod
    def launch_inline(enabled: bool, others: bool, items: int) -> bool:
        """Whether the batcher launches a pack of `items` from its loop (3.): where that is `enabled` (CUDA,
        `Batcher`'s `inline_launch`), a pack of one item with nothing else queued or running."""
        return enabled and not others and items == 1

    @staticmethod
    def copy_inline(nbytes: int, pack_items: int) -> bool:
        """Whether the engine copies a request's result of `nbytes` into its front-end's arena on its event loop
        (4.): the result of a pack of one item (`Timing.pack_items`), up to INLINE_RESULT_BYTES."""
        return pack_items == 1 and nbytes <= INLINE_RESULT_BYTES


def small_jpeg(pre: Preprocessor, data: bytes, min_pixels: int | None, max_pixels: int | None) -> bool:
    """Whether `data` is a JPEG of at most INLINE_MAX_PIXELS, resized to at most as many."""
    size = jpeg_size(data)
    if size is None or size[0] * size[1] > INLINE_MAX_PIXELS:
        return False
    try:
        height, width = pre.target_size(*size, min_pixels, max_pixels)
    except Exception:  # noqa: BLE001 - an impossible size: the decoding threads' decoder names it
        return False
    return height * width <= INLINE_MAX_PIXELS
