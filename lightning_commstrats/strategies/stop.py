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

SLURM's requeue signal has the same hazard. Under SLURM with ``auto_requeue`` Lightning registers a
handler for the requeue signal (``SLURMEnvironment.requeue_signal``, SIGUSR1 by default) that saves
an HPC checkpoint from inside the handler (a strategy's state gathering, its barriers: collectives)
and then has rank 0 run ``scontrol requeue``. :class:`StopAgreement` replaces that handler too:

* the handler only notes the signal (Lightning's does not forward it to child processes, and
  neither does this one: SLURM signals every task itself);
* the noted signal sets the same flag as a SIGTERM in the round of the next batch, so it reaches
  every rank within the same bound;
* at the batch where the ranks agree to stop, they run one more round on the same channel, once:
  whether any rank noted the requeue signal. ``FlagChannel`` carries one boolean per round (a MAX
  of 0 or 1), so the two flags cannot share one round without changing the channel; the extra round
  runs only at the stop and only when Lightning handles requeues, and the per-batch cost and bound
  of the stop rounds stay what they were;
* when it says yes, every rank runs Lightning's own requeue handler there, at the batch boundary and
  outside any signal handler: every rank saves the HPC checkpoint (its collectives meet on every
  rank), rank 0 requeues the job; then every rank raises ``SIGTERMException`` as after a SIGTERM
  (the training after a requeue would be lost: SLURM ends the job to requeue it).

Without ``together`` (the asynchronous parameter server's workers) a rank that notes the requeue
signal runs the requeue handler alone at its next batch (outside the handler still): SLURM sends the
signal to every task, so every worker saves at its own next batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import FrameType
from typing import Any

from lightning_commstrats.comm import Communicator
from lightning_commstrats.comm.base import FlagChannel

try:  # Lightning >= 2.5
    from lightning.pytorch.utilities.exceptions import SIGTERMException
except ImportError:  # pragma: no cover - older Lightning stops on its own flag at the end of a step
    SIGTERMException = None  # type: ignore[assignment,misc]

try:
    from lightning.fabric.plugins.environments import SLURMEnvironment
except ImportError:  # pragma: no cover - Lightning without fabric's environments: no requeue handling to replace
    SLURMEnvironment = None  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)


class StopAgreement:
    """The ranks' agreement on stopping after a SIGTERM or SLURM's requeue signal (see the module's docstring).

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
        self.requeue_requested = False  # this rank got SLURM's requeue signal
        self.stopped_at_batch: int | None = None
        self.requeued_at_batch: int | None = None  # the batch at which this rank ran the requeue handler
        self._channel: FlagChannel | None = None
        self._trainer: Any = None
        self._batches = 0
        # Lightning's requeue handler (bound to the Trainer's signal connector) and its signal, while
        # this agreement stands in for it; None when Lightning does not handle requeues in this run
        self._requeue: Callable[[int, FrameType | None], Any] | None = None
        self._requeue_signum = 0

    def attach(self, trainer: Any, comm: Communicator) -> None:
        """Take over the Trainer's SIGTERM handling, and under SLURM with ``auto_requeue`` its
        requeue handling, for one fit (before Lightning registers its handlers: from the strategy's
        ``setup``). Every rank calls it at the same point."""
        connector = getattr(trainer, "_signal_connector", None)
        if connector is None or SIGTERMException is None or not hasattr(connector, "_sigterm_notifier_fn"):
            return  # another Lightning: its own handling stays
        self.requested = False
        self.requeue_requested = False
        self.stopped_at_batch = None
        self.requeued_at_batch = None
        self._batches = 0
        self._trainer = trainer
        # Instance attributes shadow the methods: register_signal_handlers looks them up when it runs.
        connector._sigterm_notifier_fn = self.notify
        connector.__dict__.pop("_slurm_sigusr_handler_fn", None)  # the class's handler, not a stale stand-in
        self._requeue = None
        environment = getattr(getattr(trainer, "_accelerator_connector", None), "cluster_environment", None)
        original = getattr(connector, "_slurm_sigusr_handler_fn", None)
        if _handles_requeue(environment) and callable(original):
            # the same on every rank (the run's cluster environment): every rank runs the requeue round
            self._requeue = original
            self._requeue_signum = int(environment.requeue_signal)
            connector._slurm_sigusr_handler_fn = self.notify_requeue
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
        connector.__dict__.pop("_slurm_sigusr_handler_fn", None)
        self._requeue = None
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        if loop is not None:
            loop.__dict__.pop("_broadcast_sigterm_tensor", None)
        if self.requested:  # a signal that came after the last batch: the script can still see it
            connector.received_sigterm = True
        if self.requeue_requested and self.requeued_at_batch is None:
            log.warning(
                "rank %s: the requeue signal came after the last training batch: no HPC checkpoint was saved and"
                " the job was not requeued",
                getattr(trainer, "global_rank", "?"),
            )

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

    def notify_requeue(self, signum: int, frame: FrameType | None) -> None:
        """The handler of SLURM's requeue signal: note it; no checkpoint, no collective here. The
        ranks save and requeue together at the start of a training batch (:meth:`poll`)."""
        first = not self.requeue_requested
        self.requeue_requested = True
        if first:
            log.info(
                "rank %s: received the requeue signal %d; every rank saves an HPC checkpoint and stops at the"
                " start of a training batch within %d",
                getattr(self._trainer, "global_rank", "?"),
                signum,
                2 * self.every,
            )

    def poll(self) -> None:
        """At the start of a training batch (every rank, the same batches): raise
        ``SIGTERMException`` on every rank at once when any rank got the signal; when any rank got
        SLURM's requeue signal, every rank first runs Lightning's requeue handler, here."""
        if self._trainer is None:
            return
        self._batches += 1
        if self._channel is None:
            stop = self.requested or self.requeue_requested
            requeue = self.requeue_requested
        elif (self._batches - 1) % self.every:
            return  # no round at this batch: every rank skips the same ones
        else:
            stop = self._channel.result()
            if not stop:
                self._channel.start(self.requested or self.requeue_requested)
            requeue = stop and self._agree_on_requeue()
        if stop:
            self.stopped_at_batch = self._batches
            if requeue and self._requeue is not None:
                self.requeued_at_batch = self._batches
                # Lightning's own handler, called as a function: the loggers finalized, the HPC
                # checkpoint saved (collective), rank 0 runs ``scontrol requeue``
                self._requeue(self._requeue_signum, None)
            self._trainer._signal_connector.received_sigterm = True
            raise SIGTERMException()

    def stop_waiting(self) -> None:
        """For a wait outside the batches that may last long (a replica waiting for its quorum):
        raise ``SIGTERMException`` now when this rank got the signal. The rank stops alone, at once;
        the ranks it would have met learn it as they learn of any rank that stops (a replica's other
        ranks through its heartbeats, the other replicas through the Lighthouse)."""
        if self.requested and self._trainer is not None and SIGTERMException is not None:
            log.warning(
                "rank %s: stopping on the signal while waiting for a quorum", getattr(self._trainer, "global_rank", "?")
            )
            self._trainer._signal_connector.received_sigterm = True
            raise SIGTERMException()

    def _agree_on_requeue(self) -> bool:
        """Once the ranks agreed to stop: whether any of them noted the requeue signal. One more
        round on the channel (it carries one boolean a round), at this batch only, on every rank
        alike (``_requeue`` comes from the run's cluster environment)."""
        if self._requeue is None or self._channel is None:
            return False
        self._channel.start(self.requeue_requested)
        return self._channel.result()

    def finish(self) -> None:
        """At the normal end of training: read the round in flight (every rank started it), so
        the channel is clear for the next fit; a signal it carries is noted for the script."""
        if self._channel is not None and self._channel.pending and self._channel.result():
            self.requested = True


def check_stop_check_every(every: Any) -> None:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"stop_check_every must be an int >= 1 (batches between two stop rounds), got {every!r}")


def _handles_requeue(environment: Any) -> bool:
    """Whether Lightning registers its requeue handler in a run on ``environment`` (see
    ``_SignalConnector.register_signal_handlers``): SLURM with ``auto_requeue``, a requeue signal."""
    return (
        SLURMEnvironment is not None
        and isinstance(environment, SLURMEnvironment)
        and bool(environment.auto_requeue)
        and environment.requeue_signal is not None
    )


def _no_broadcast() -> None:
    """Replaces Lightning's per-batch broadcast of rank 0's SIGTERM flag (see the module)."""
