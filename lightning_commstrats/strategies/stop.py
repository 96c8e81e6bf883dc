"""SIGTERM as an agreement between ranks: every rank of a run stops at the same step boundary.

Lightning (2.5, 2.6) answers SIGTERM with a ``dist.broadcast`` issued from inside the signal
handler, and broadcasts rank 0's flag again at the start of every training batch. A Python signal
handler runs in the main thread between two bytecodes, wherever the rank happens to be: in the
middle of a scheme's exchange (between two of its collectives), while its peers wait in the next
collective of that exchange. The handler's broadcast then pairs with a collective of another kind
and size: the run hangs (or worse, reads garbage). A rank other than 0 that gets the signal is
not even heard by the broadcast; it raises alone at the end of its step, and its peers hang in
their next collective. Preemption (SLURM, Kubernetes, spot instances) sends exactly this signal.

:class:`StopAgreement` replaces both, for the runs of the package's strategies:

* the handler only notes the signal (and, as Lightning's does, forwards it to the ranks Lightning
  started itself): no collective from inside a handler;
* at the start of every training batch, every rank reads the OR of every rank's flag from the
  previous round and sends its own for the next, on a channel of its own
  (:meth:`~lightning_commstrats.comm.Communicator.flag_channel`: a CPU gloo group, or a
  duplicate MPI communicator). The round runs while the rank trains its batch, so no rank waits
  for it unless a peer is a whole batch behind (the per-batch coupling Lightning's broadcast had,
  with one batch of slack and no CUDA synchronisation);
* once the OR is set, every rank raises Lightning's ``SIGTERMException`` at the same batch, and
  Lightning's ``on_exception`` hooks run on every rank at the same point of the run: a callback
  may save a checkpoint there (its collectives meet on every rank).

Bound: every rank stops at the start of the second training batch after the signal reaches any
rank (the round in flight carries the flags of before the signal), plus whatever that rank is
doing when the signal comes (a periodic sync, a validation).

``every`` (the strategies' ``stop_check_every``) runs a round at every ``every``-th batch only,
each round read ``every`` batches after it started: one small all-reduce per ``every`` batches
instead of per batch (each round is a few tiny packets per hop, so its bytes on the wire are
mostly headers, which a top-k scheme's payload of a few KB per step notices) and ``every`` batches
of slack instead of one. The bound grows to ``2 * every`` batches.
"""

from __future__ import annotations

import logging
from types import FrameType
from typing import Any

from lightning_commstrats.comm import Communicator
from lightning_commstrats.comm.base import FlagChannel

try:  # Lightning >= 2.5
    from lightning.pytorch.utilities.exceptions import SIGTERMException
except ImportError:  # pragma: no cover - older Lightning stops on its own flag at the end of a step
    SIGTERMException = None  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)


class StopAgreement:
    """The ranks' agreement on stopping after a SIGTERM (see the module's docstring).

    Args:
        together: agree over the ranks (default). ``False``: a rank that gets the signal stops at
            its next batch alone, and its peers learn of it as they learn of any rank that stops
            (the asynchronous parameter server's workers, which never wait for each other).
        every: batches between two rounds (default 1: a round per batch); every rank stops within
            ``2 * every`` batches of the signal.
    """

    def __init__(self, together: bool = True, every: int = 1) -> None:
        check_stop_check_every(every)
        self.together = together
        self.every = every
        self.requested = False  # this rank got the signal
        self.stopped_at_batch: int | None = None
        self._channel: FlagChannel | None = None
        self._trainer: Any = None
        self._batches = 0

    def attach(self, trainer: Any, comm: Communicator) -> None:
        """Take over the Trainer's SIGTERM handling for one fit (before Lightning registers its
        handlers: from the strategy's ``setup``). Every rank calls it at the same point."""
        connector = getattr(trainer, "_signal_connector", None)
        if connector is None or SIGTERMException is None or not hasattr(connector, "_sigterm_notifier_fn"):
            return  # another Lightning: its own handling stays
        self.requested = False
        self.stopped_at_batch = None
        self._batches = 0
        self._trainer = trainer
        # Instance attributes shadow the methods: register_signal_handlers looks them up when it runs.
        connector._sigterm_notifier_fn = self.notify
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        if loop is not None and hasattr(loop, "_broadcast_sigterm_tensor"):
            loop._broadcast_sigterm_tensor = _no_broadcast
        if self.together and comm.world_size > 1:
            self._channel = comm.flag_channel()

    def detach(self) -> None:
        """Give the Trainer its own handling back (the end of a fit, whatever the way)."""
        trainer, self._trainer = self._trainer, None
        if trainer is None:
            return
        channel, self._channel = self._channel, None
        if channel is not None and not channel.pending:
            channel.close()  # one channel per fit: none outlives the process group it was made on
        # else the fit stopped on an error and the peers may not have started this round: the
        # channel is dropped unread
        connector = trainer._signal_connector
        connector.__dict__.pop("_sigterm_notifier_fn", None)
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        if loop is not None:
            loop.__dict__.pop("_broadcast_sigterm_tensor", None)
        if self.requested:  # a signal that came after the last batch: the script can still see it
            connector.received_sigterm = True

    def notify(self, signum: int, frame: FrameType | None) -> None:
        """The SIGTERM handler: note the signal, forward it to the ranks Lightning started itself
        (as Lightning does); no collective here."""
        first = not self.requested
        self.requested = True
        if first:
            trainer = self._trainer
            log.info(
                "rank %s: received signal %d; every rank stops at the start of a training batch within two",
                getattr(trainer, "global_rank", "?"),
                signum,
            )
            launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
            if launcher is not None:
                launcher.kill(signum)

    def poll(self) -> None:
        """At the start of a training batch (every rank, the same batches): raise
        ``SIGTERMException`` on every rank at once when any rank got the signal."""
        if self._trainer is None:
            return
        self._batches += 1
        if self._channel is None:
            stop = self.requested
        elif (self._batches - 1) % self.every:
            return  # no round at this batch: every rank skips the same ones
        else:
            stop = self._channel.result()
            if not stop:
                self._channel.start(self.requested)
        if stop:
            self.stopped_at_batch = self._batches
            self._trainer._signal_connector.received_sigterm = True
            raise SIGTERMException()

    def finish(self) -> None:
        """At the normal end of training: read the round in flight (every rank started it), so
        the channel is clear for the next fit; a signal it carries is noted for the script."""
        if self._channel is not None and self._channel.pending and self._channel.result():
            self.requested = True


def check_stop_check_every(every: Any) -> None:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"stop_check_every must be an int >= 1 (batches between two stop rounds), got {every!r}")


def _no_broadcast() -> None:
    """Replaces Lightning's per-batch broadcast of rank 0's SIGTERM flag (see the module)."""
