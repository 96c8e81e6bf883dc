"""The zoo of one-line semantic mutants that the suite must kill (issue 53; run by ``tests/mutants/run.py``).

Each :class:`Mutant` replaces one exact piece of one line of the package with another: an average that
sums, a residual committed before the vote, a schedule off by one, a seed from the wrong mesh dimension,
a buffer routed through a quantized hop, a pseudo-gradient's sign... The runner refuses a mutant whose
``original`` text is not found exactly once in its file, so that a mutant never silently stops applying
when the code changes (``tests/test_mutant_zoo.py`` checks the same in the quick suite).

``tests`` names what runs against the mutant, in order, stopping at the first failure (a kill): pytest
paths or node ids relative to the repository root. A file stands for its quick tests (those not marked
``slow``); a node id runs as named, slow or not. The reference (``tests/multiprocess/test_reference_ranks.py``)
and the quick matrix cases (``tests/multiprocess/test_matrix_ranks.py -m "not slow"``) are added to every
mutant's list: first the reference when ``reference_first`` (the schemes it replays), else after the
mutant's own tests; the matrix last. A mutant's own tests are kept few (the zoo runs in about half an
hour on two cores): unit files whole, multiprocess tests by node id where a whole file would cost minutes.

``survives`` is for a mutant known to survive: why (an equivalent mutant, or what no test checks). The
runner reports a survivor without it as unexplained.
"""

from __future__ import annotations

from dataclasses import dataclass

REFERENCE = "tests/multiprocess/test_reference_ranks.py"
MATRIX = "tests/multiprocess/test_matrix_ranks.py"

OUTER_UNIT = "tests/test_outer.py"
CODEC_UNIT = ("tests/compression/test_quantizers.py", "tests/compression/test_codec_reference.py")
AGGREGATION_UNIT = "tests/compression/test_aggregation.py"
NONFINITE = "tests/multiprocess/test_nonfinite_ranks.py"
INF_ON_ONE_RANK = "test_an_inf_on_one_rank_is_reported_everywhere_and_keeps_the_residuals"
SKIP_POLICY = f"{NONFINITE}::test_skip_policy_skips_the_step_on_every_rank_and_changes_no_state"
SKIP_SHARDED = f"{NONFINITE}::test_a_skipped_step_leaves_every_residual_of_a_sharded_compressed_exchange_on_every_rank"
SKIP_EVERY_SCHEME = f"{NONFINITE}::test_every_scheme_skips_a_nan_on_every_rank"
ROUTES = "tests/multiprocess/test_routes_ranks.py"
CNTK = "tests/multiprocess/test_cntk_reference_ranks.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository root
    original: str  # exact text, found exactly once in ``file``
    mutated: str  # what replaces it (same line)
    what: str  # the mistake, in one line
    tests: tuple[str, ...] = ()
    reference_first: bool = True
    survives: str = ""  # why it is expected to survive (empty: it must be killed)

    def apply(self, text: str) -> str:
        """``text`` (the file's) with the mutation; ``ValueError`` unless ``original`` occurs exactly once."""
        count = text.count(self.original)
        if count != 1:
            raise ValueError(f"mutant {self.name}: {self.original!r} occurs {count} times in {self.file}, not once")
        return text.replace(self.original, self.mutated)


OUTER = "lightning_commstrats/outer.py"
PERIODIC = "lightning_commstrats/strategies/periodic.py"
FRAGMENTS = "lightning_commstrats/strategies/fragments.py"
AGGREGATION = "lightning_commstrats/compression/aggregation.py"
QUANTIZERS = "lightning_commstrats/compression/quantizers.py"
HIERARCHICAL = "lightning_commstrats/compression/hierarchical.py"
BASE = "lightning_commstrats/strategies/base.py"

ZOO: tuple[Mutant, ...] = (
    # ------------------------------------------------------------------ averages that sum
    Mutant(
        "gradient_average_sums",
        "lightning_commstrats/strategies/reducer.py",
        'return self._replicas.all_reduce(flat, "avg", tag=tag)',
        'return self._replicas.all_reduce(flat, "sum", tag=tag)',
        "the gradient bucket's all-reduce sums instead of averaging (allreduce, warm starts)",
    ),
    Mutant(
        "fp32_bucket_average_sums",
        "lightning_commstrats/compression/exchange.py",
        'out = self.comm.all_reduce(flat, "avg", tag=tag)',
        'out = self.comm.all_reduce(flat, "sum", tag=tag)',
        "the fused fp32 buckets (pseudo-gradients, buffers) are summed, not averaged",
    ),
    Mutant(
        "quantized_average_sums",
        AGGREGATION,
        "lines = self.codec.decode(next(payloads), lay.cols, lay.rows).div_(n)",
        "lines = self.codec.decode(next(payloads), lay.cols, lay.rows).div_(1)",
        "the quantized all-reduce returns the ranks' sum (8-bit DiLoCo, 1-bit SGD)",
    ),
    Mutant(
        "sharded_cross_group_average_sums",
        HIERARCHICAL,
        'return self.across.all_reduce(flat, "avg", tag=tag)',
        'return self.across.all_reduce(flat, "sum", tag=tag)',
        "with shard='fsdp' the fp32 hop across groups sums the groups' gradients",
    ),
    Mutant(
        "two_level_divides_by_groups",
        HIERARCHICAL,
        "return full[:n].div_(world)",
        "return full[:n].div_(self.num_groups)",
        "the two-level all-reduce divides by the number of groups, not of ranks",
        (
            "tests/multiprocess/test_two_level_ranks.py::test_fp32_two_levels_equal_the_flat_average_and_charge_each_level",
        ),
        reference_first=False,
    ),
    Mutant(
        "expert_gradients_over_replicas_only",
        "lightning_commstrats/strategies/expert_parallel.py",
        'return self.dp_comm.all_reduce(flat, "sum", tag="grad_experts").div_(self.world_size)',
        'return self.dp_comm.all_reduce(flat, "sum", tag="grad_experts").div_(self.dp_size)',
        "expert gradients divided by their replicas, not the world (they hold the group's sum already)",
        ("tests/multiprocess/test_moe_precision_ranks.py",),
        reference_first=False,
    ),
    Mutant(
        "parameter_server_round_sums",
        "lightning_commstrats/strategies/parameter_server.py",
        "total.div_(self.world_size)",
        "total.div_(1)",
        "the parameter server's synchronous round sums the workers' gradients",
        ("tests/strategies/test_parameter_server.py",),
        reference_first=False,
    ),
    Mutant(
        "local_sgd_average_sums",
        "lightning_commstrats/strategies/local_sgd.py",
        'self.comm.all_reduce(t, "avg", tag="weights")',
        'self.comm.all_reduce(t, "sum", tag="weights")',
        "local_sgd's MPI exchange sums the pseudo-gradients",
        ("tests/multiprocess/test_weight_exchange_ranks.py::test_local_sgd_over_mpi_equals_model_averaging_over_gloo",),
        reference_first=False,
    ),
    Mutant(
        "samples_weighting_off",
        "lightning_commstrats/strategies/model_averaging.py",
        "scale = self.world_size * mine / total if total > 0 else 1.0",
        "scale = mine / total if total > 0 else 1.0",
        "weighting='samples' scales by n_r / sum n without N: the weighted mean shrinks N times",
        (f"{CNTK}::test_model_averaging_weighted_by_each_rank_s_samples_on_uneven_batches",),
        reference_first=False,
    ),
    # ------------------------------------------------------------------ the outer step
    Mutant(
        "pseudo_gradient_sign",
        PERIODIC,
        "grad = self.outer.start_point(fragment) - local",
        "grad = local - self.outer.start_point(fragment)",
        "the pseudo-gradient is w_local - w_start: the outer step climbs",
        (OUTER_UNIT,),
    ),
    Mutant(
        "outer_momentum_ignored",
        OUTER,
        'built.setdefault("momentum", momentum)',
        'built.setdefault("momentum", 0.0)',
        "the outer optimizer is built without its momentum (DiLoCo, Streaming DiLoCo)",
        (OUTER_UNIT,),
    ),
    Mutant(
        "outer_nesterov_off",
        OUTER,
        'built.setdefault("nesterov", True)',
        'built.setdefault("nesterov", False)',
        "the outer SGD takes heavy-ball momentum instead of Nesterov's",
        (OUTER_UNIT,),
    ),
    Mutant(
        "outer_lr_ignored",
        OUTER,
        'built = {"lr": lr, **extra}',
        'built = {"lr": 1.0, **extra}',
        "the outer optimizer steps at lr 1 whatever outer_lr says",
        (OUTER_UNIT,),
    ),
    Mutant(
        "bmuf_block_momentum_ignored",
        OUTER,
        'delta.mul_(group["momentum"]).sub_(p.grad, alpha=group["lr"])',
        'delta.mul_(0.0).sub_(p.grad, alpha=group["lr"])',
        "BMUF's filter forgets its block momentum (delta = -lr G)",
        (OUTER_UNIT,),
    ),
    Mutant(
        "bmuf_block_lr_ignored",
        OUTER,
        'delta.mul_(group["momentum"]).sub_(p.grad, alpha=group["lr"])',
        'delta.mul_(group["momentum"]).sub_(p.grad, alpha=1.0)',
        "BMUF's filter ignores the block learning rate",
        (OUTER_UNIT,),
    ),
    Mutant(
        "bmuf_nesterov_reversed",
        OUTER,
        'if not group["nesterov"] or delta is None:',
        'if group["nesterov"] or delta is None:',
        "BMUF's Nesterov branch reversed: look-ahead starts without Nesterov, none with it",
        (OUTER_UNIT,),
    ),
    Mutant(
        "cntk_nesterov_sign",
        OUTER,
        "p.sub_(sg, alpha=bm)",
        "p.add_(sg, alpha=bm)",
        "CNTK's Nesterov look-ahead added instead of subtracted",
        (OUTER_UNIT, f"{CNTK}::test_bmuf_paper_and_cntk_forms_block_by_block_against_their_references"),
        reference_first=False,
    ),
    Mutant(
        "bmuf_momentum_counts_ranks",
        "lightning_commstrats/strategies/bmuf.py",
        "return 1.0 - 1.0 / self.num_models",
        "return 1.0 - 1.0 / self.world_size",
        "BMUF's default block momentum counts ranks, not models (sharded groups)",
    ),
    Mutant(
        "end_of_fit_merge_sign",
        PERIODIC,
        "w.sub_(pseudo_grad.to(w.device, torch.float32))",
        "w.add_(pseudo_grad.to(w.device, torch.float32))",
        "the end-of-fit merge adds the ranks' average progress with the wrong sign",
    ),
    Mutant(
        "mixing_reversed",
        PERIODIC,
        "torch.lerp(start, self.flat_weights(f), alpha)",
        "torch.lerp(self.flat_weights(f), start, alpha)",
        "fragment_update_alpha weighs the global model instead of the local one",
    ),
    Mutant(
        "momentum_reset_inverted",
        PERIODIC,
        "if self.reset_sgd_momentum:",
        "if not self.reset_sgd_momentum:",
        "reset_sgd_momentum inverted: the inner first moment is zeroed when it must be kept",
    ),
    Mutant(
        "reset_zeroes_second_moment",
        "lightning_commstrats/strategies/trainer_hooks.py",
        'MOMENTUM_KEYS = ("momentum_buffer", "exp_avg")',
        'MOMENTUM_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq")',
        "the momentum reset also zeroes Adam's second moment",
    ),
    # ------------------------------------------------------------------ schedules
    Mutant(
        "sync_schedule_off_by_one",
        FRAGMENTS,
        "if now - start >= self.sync_period]",
        "if now - start > self.sync_period]",
        "a fragment syncs one unit after its block ends (H + 1)",
    ),
    Mutant(
        "fragments_in_reverse_order",
        FRAGMENTS,
        "self.block_start = [now - h + (k + 1) * h // f for k in range(f)]",
        "self.block_start = [now - h + (f - k) * h // f for k in range(f)]",
        "Streaming DiLoCo's fragments take their turns in reverse order",
    ),
    Mutant(
        "fragment_delay_off_by_one",
        PERIODIC,
        "if self._inflight is not None and self.optimizer_steps >= self._inflight.apply_at:",
        "if self._inflight is not None and self.optimizer_steps > self._inflight.apply_at:",
        "an exchange in flight lands one step after fragment_sync_delay",
    ),
    Mutant(
        "resume_wrong_counter",
        BASE,
        'self.optimizer_steps = int(state["optimizer_steps"])',
        'self.optimizer_steps = int(state["samples_per_worker"])',
        "a resumed run restores its step counter from the sample counter",
    ),
    Mutant(
        "heal_adopts_wrong_counter",
        PERIODIC,
        'steps = int(state["optimizer_steps"])',
        'steps = int(state["samples_per_worker"])',
        "a healed replica takes its step counter from the sample counter of the replica it healed from",
        (
            "tests/multiprocess/test_replica_ranks.py::"
            "test_a_dead_rank_takes_its_replica_out_and_the_restarted_replica_heals_rank_by_rank[replicated-rank1-dies]",
        ),
        reference_first=False,
    ),
    # ------------------------------------------------------------------ codecs and error feedback
    Mutant(
        "error_feedback_dropped",
        AGGREGATION,
        "res = self.parking.visit(self.residuals.get(name), v.device)",
        "res = None",
        "the stage-1 residual is never added back (no error feedback)",
        (AGGREGATION_UNIT,),
    ),
    Mutant(
        "stage2_residual_sign",
        AGGREGATION,
        "torch._foreach_add_([t for t, _ in with_res2], [r for _, r in with_res2])",
        "torch._foreach_sub_([t for t, _ in with_res2], [r for _, r in with_res2])",
        "the owner's stage-2 residual is subtracted instead of added",
        (AGGREGATION_UNIT,),
    ),
    Mutant(
        "residual_sign",
        AGGREGATION,
        "v[c0:c1] -= deq",
        "v[c0:c1] += deq",
        "1-bit SGD's residual keeps g + q instead of g - q",
        (AGGREGATION_UNIT,),
    ),
    Mutant(
        "onebit_means_swapped",
        QUANTIZERS,
        "return positive, torch.stack([neg_mean, pos_mean])",
        "return positive, torch.stack([pos_mean, neg_mean])",
        "1-bit codes rebuild as the other sign's mean",
        CODEC_UNIT,
    ),
    Mutant(
        "uniform_step_off_by_one_level",
        QUANTIZERS,
        "step = (hi - lo) / bins",
        "step = (hi - lo) / (bins - 1)",
        "the uniform grid's encoder cuts [lo, hi] into 2^b - 1 bins, the decoder into 2^b",
        CODEC_UNIT,
    ),
    Mutant(
        "uniform_statistics_per_tensor",
        QUANTIZERS,
        "var, mean = torch.var_mean(x, dim=1, correction=0)",
        "var, mean = torch.var_mean(x, correction=0)",
        "the uniform grid's mean +- k std is the whole block's instead of each line's",
        CODEC_UNIT,
    ),
    Mutant(
        "scales_per_column_not_row",
        AGGREGATION,
        "rows, cols = (rest, first) if by_rows else (first, rest)",
        "rows, cols = (first, rest)",
        "pseudo_grad_scales='rows' quantizes per column (1-bit SGD's layout)",
        (AGGREGATION_UNIT,),
    ),
    Mutant(
        "e3m0_scale_per_tensor",
        QUANTIZERS,
        "scale = magnitude.amax(1) if block.shape[1] else block.new_zeros(block.shape[0])",
        "scale = magnitude.amax().expand(block.shape[0]) if block.shape[1] else block.new_zeros(block.shape[0])",
        "E3M0's scale is the block's largest magnitude instead of each line's",
        CODEC_UNIT,
        reference_first=False,
    ),
    Mutant(
        "e3m0_sign_flipped",
        QUANTIZERS,
        "codes += ((block < 0) & (codes > 0)).to(torch.uint8) << 3",
        "codes += ((block > 0) & (codes > 0)).to(torch.uint8) << 3",
        "E3M0's sign bit set for the positive values",
        CODEC_UNIT,
        reference_first=False,
    ),
    Mutant(
        "topk_keeps_smallest",
        "lightning_commstrats/compression/sparse.py",
        "positions = block.abs().topk(k, dim=1, sorted=False).indices",
        "positions = block.abs().topk(k, dim=1, largest=False, sorted=False).indices",
        "SparseLoCo's top-k keeps the smallest magnitudes",
        ("tests/compression/test_sparse.py",),
        reference_first=False,
    ),
    Mutant(
        "sparse_decay_ignored",
        "lightning_commstrats/compression/sparse.py",
        "if self.decay != 1.0:",
        "if self.decay == 1.0:",
        "the sparse error feedback is never decayed (beta taken as 1)",
        ("tests/compression/test_sparse.py",),
        reference_first=False,
    ),
    # ------------------------------------------------------------------ non-finite values and the vote
    Mutant(
        "nonfinite_squashed",
        AGGREGATION,
        "v += torch.where(_all_finite(v), 0.0, math.nan)",
        "v += torch.where(_all_finite(v), 0.0, 0.0)",
        "an inf in a quantized gradient is not made NaN: a codec that clips would squash it into finite codes",
        ("tests/compression/test_nonfinite_guard.py", f"{NONFINITE}::{INF_ON_ONE_RANK}"),
        reference_first=False,
    ),
    Mutant(
        "nonfinite_step_not_skipped",
        BASE,
        'if self._nonfinite_names and self.handle_nonfinite(self._nonfinite_names, "gradients"):',
        'if self._nonfinite_names and not self.handle_nonfinite(self._nonfinite_names, "gradients"):',
        "nonfinite='skip' takes the step with the non-finite gradient",
        (SKIP_POLICY,),
    ),
    Mutant(
        "nonfinite_block_not_discarded",
        PERIODIC,
        'if pending.nonfinite and self.handle_nonfinite(pending.nonfinite, f"pseudo-gradients (fragment {f})"):',
        'if pending.nonfinite and not self.handle_nonfinite(pending.nonfinite, f"pseudo-gradients (fragment {f})"):',
        "nonfinite='skip' takes the outer step with a non-finite pseudo-gradient",
        (SKIP_EVERY_SCHEME,),
    ),
    Mutant(
        "onebit_residual_committed_before_vote",
        "lightning_commstrats/strategies/allreduce.py",
        "            commit=False,\n",
        "            commit=True,\n",
        "a compressed gradient exchange keeps its residuals before the step's vote (a skipped step moves them)",
        (SKIP_SHARDED,),
        reference_first=False,
    ),
    Mutant(
        "slow_hop_residual_committed_before_vote",
        HIERARCHICAL,
        "out = self.quantized({name: matrix}, commit=not self.hold)[name]",
        "out = self.quantized({name: matrix}, commit=True)[name]",
        "the quantized slow hop keeps its residuals before the step's vote",
        (ROUTES,),
        reference_first=False,
    ),
    Mutant(
        "buffers_through_quantized_hop",
        BASE,
        "self.all_reduce_fused(wide, tag=tag, names=names, route=BUFFERS)",
        "self.all_reduce_fused(wide, tag=tag, names=names, route=GRADIENTS)",
        "module buffers are averaged on the gradients' route, through the quantized slow hop",
        (ROUTES,),
        reference_first=False,
    ),
    # ------------------------------------------------------------------ seeds and rows
    Mutant(
        "seed_from_wrong_mesh_dimension",
        "lightning_commstrats/sharding/materialize.py",
        "streams.append(kept_index)",
        "streams.append(index)",
        "built empty, the experts draw from the FSDP2 index, not the expert-parallel one",
        (
            "tests/test_materialize.py",
            "tests/multiprocess/test_empty_distribution_ranks.py",
        ),
        reference_first=False,
    ),
    Mutant(
        "sampled_rows_per_rank",
        "lightning_commstrats/strategies/sampled_vocab.py",
        "beta = random_rows(v, self._beta, self.seed, self.optimizer_steps)",
        "beta = random_rows(v, self._beta, self.seed + self.global_rank, self.optimizer_steps)",
        "the random vocabulary rows are drawn per rank: the ranks exchange different rows",
        ("tests/strategies/test_sampled_vocab.py", "tests/multiprocess/test_sampled_vocab_ranks.py"),
        reference_first=False,
    ),
    # ------------------------------------------------------------------ the Adam schemes
    Mutant(
        "onebit_adam_momentum_weights_swapped",
        "lightning_commstrats/strategies/onebit_adam.py",
        'torch._foreach_lerp_(grads, [s["exp_avg"] for s in states], group["betas"][0])',
        'torch._foreach_lerp_(grads, [s["exp_avg"] for s in states], 1 - group["betas"][0])',
        "1-bit Adam's momentum weighs the gradient by beta1 and the old momentum by 1 - beta1",
        ("tests/strategies/test_onebit_adam.py",),
        reference_first=False,
    ),
    Mutant(
        "zero_one_adam_interval_never_doubles",
        "lightning_commstrats/strategies/zero_one_adam.py",
        "done, end, interval = done + self.var_update_scaler, last, interval * 2",
        "done, end, interval = done + self.var_update_scaler, last, interval",
        "0/1 Adam's variance-update interval never doubles",
        ("tests/strategies/test_zero_one_adam.py",),
        reference_first=False,
    ),
)
