"""Teacher side: turn the teacher's last-stage logits into a :class:`TeacherPayload`.

Runs on every rank of the teacher's last pipeline stage. Input: this rank's logits shard
[B, T_local, V_local] (vocabulary over teacher TP, positions over teacher CP in Megatron's 2*CP
order; GPTModel with ``labels=None`` returns [b, s, v]) and the teacher *predicting* chunk id of
each local position (shifted on the full sequence, then sliced for the CP rank). The reductions
(log-softmax over TP, chunk means over CP, top-k across TP shards) happen here, so the result is
the same on every TP/CP rank of the replica and independent of the teacher's layout.
Columns >= ``vocab_size`` (Megatron's padding) get no probability.
"""

from __future__ import annotations

import torch

from megatron_xdistill.loss.blocks.block_size import BLOCK_BYTES
from megatron_xdistill.loss.blocks.chunk_rows import ChunkRows, build_chunk_rows
from megatron_xdistill.loss.collectives import Group, all_gather, all_reduce, group_rank
from megatron_xdistill.loss.cpu import exact as exact_rows
from megatron_xdistill.loss.definitions.common import TINY, UNCOMMON_TOPK
from megatron_xdistill.loss.definitions.formulas import gold_topk_sizes, gold_topk_teacher
from megatron_xdistill.loss.definitions.payload import PayloadSpec, TeacherPayload, float64_as_pair


def payload_spec(form: str, num_chunks: int, teacher_vocab_size: int, topk: int | None = None,
                 num_common: int | None = None, uncommon_topk: int = UNCOMMON_TOPK,
                 num_image: int | None = None, *, gold_topk: int = 0,
                 gold_uncommon_topk: int = 0, student_vocab_size: int | None = None
                 ) -> PayloadSpec:
    """The payload shape for a loss configuration (known before any data: for routing plans).

    ``form``: "full" (exact P-KL), "image" (exact P-KL on W's image of ``num_image`` teacher
    ids, :func:`kernels.image_projection.teacher_image`), "topk" (``topk`` microbatch-global
    columns), "chunk_topk" (``topk`` columns per chunk + tail), "gold" (``num_common``
    common pairs) or "gold_topk" (compact gold: the ``gold_topk`` most probable of the
    ``num_common`` pairs and ``gold_uncommon_topk`` sorted uncommon probabilities, 0 = all, of
    the n = min(``uncommon_topk``, V_t - M, V_s - M) the loss compares; give
    ``student_vocab_size`` V_s, which the student's n needs).
    """
    if form == "gold_topk":
        if num_common is None:
            raise ValueError("form 'gold_topk' needs num_common (the number of common pairs)")
        span = max(0, min(uncommon_topk, teacher_vocab_size - num_common))
        if student_vocab_size is not None:
            span = max(0, min(span, student_vocab_size - num_common))
        k, k_unc = gold_topk_sizes(gold_topk, gold_uncommon_topk, num_common, span)
        return PayloadSpec(form, num_chunks, k, k_unc, span=span, pairs=num_common)
    if form == "image":
        if num_image is None:
            raise ValueError("form 'image' needs num_image (the size of W's image)")
        return PayloadSpec(form, num_chunks, num_image)
    if form in ("topk", "chunk_topk"):
        if not topk or topk < 1:
            raise ValueError(f"form {form!r} needs topk >= 1")
        return PayloadSpec(form, num_chunks, min(topk, teacher_vocab_size))
    if form == "gold":
        if num_common is None:
            raise ValueError("form 'gold' needs num_common (the number of common pairs)")
        rest = max(0, min(uncommon_topk, teacher_vocab_size - num_common))
        return PayloadSpec(form, num_chunks, num_common, rest)
    return PayloadSpec(form, num_chunks, teacher_vocab_size)


def _merge_topk(values: torch.Tensor, ids: torch.Tensor, k: int, group: Group
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k (descending) from every TP rank's local top-k candidates [r, k]."""
    if values.shape[1] < k:  # a short shard offers -inf candidates
        pad = k - values.shape[1]
        values = torch.cat([values, values.new_full((values.shape[0], pad), float("-inf"))], 1)
        ids = torch.cat([ids, ids.new_zeros(ids.shape[0], pad)], 1)
    all_v = torch.cat(all_gather(values.contiguous(), group), 1)
    all_i = torch.cat(all_gather(ids.contiguous(), group), 1)
    top_v, pos = all_v.topk(k, dim=1)
    return top_v, all_i.gather(1, pos)


class _Teacher:
    def __init__(self, logits: torch.Tensor, spec: PayloadSpec, vocab_size: int,
                 temperature: float, common_teacher_ids: torch.Tensor | None,
                 tp_group: Group, cp_group: Group) -> None:
        """``common_teacher_ids``: the teacher ids of the payload's columns (gold: the common
        pairs' order; image: W's image, ascending)."""
        self.spec, self.temp = spec, float(temperature)
        self.tp_group, self.cp_group = tp_group, cp_group
        self.logits2d = logits.reshape(-1, logits.shape[-1])
        v_local = logits.shape[-1]
        self.vocab_start = group_rank(tp_group) * v_local
        self.num_real = max(0, min(v_local, vocab_size - self.vocab_start))
        self.dev = logits.device
        if spec.form in ("gold", "gold_topk", "image"):
            what = "image" if spec.form == "image" else "common"
            if common_teacher_ids is None:
                raise ValueError(f"a {spec.form} payload needs the teacher ids of its columns "
                                 f"({what}_teacher_ids)")
            common = torch.as_tensor(common_teacher_ids, dtype=torch.int64, device=self.dev)
            want = spec.pairs if spec.form == "gold_topk" else spec.width
            if common.numel() != want:
                raise ValueError(f"{common.numel()} {what} teacher ids, payload of {want}")
            if spec.form == "image" and common.numel() > 1 and bool((common.diff() <= 0).any()):
                raise ValueError("image_teacher_ids must be ascending and distinct (the order "
                                 "in which the student numbers W's image: teacher_image(...))")
            local = (common >= self.vocab_start) & (common < self.vocab_start + self.num_real)
            self.pair_local = torch.nonzero(local, as_tuple=True)[0]
            self.col_common = common[local] - self.vocab_start
            if spec.form == "image":  # 1 on this shard's real columns outside I
                self.outside = torch.ones(self.num_real, device=self.dev)
                self.outside[self.col_common] = 0.0

    def x(self, start: int, end: int) -> torch.Tensor:
        x = self.logits2d[start:end, : self.num_real].float()
        return x / self.temp if self.temp != 1.0 else x

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        """log_softmax over the TP-wide real vocabulary (new tensor)."""
        m = x.amax(1) if self.num_real else x.new_full((x.shape[0],), float("-inf"))
        all_reduce(m, self.tp_group, "max")
        out = x - m[:, None]
        sums = all_reduce(out.exp().sum(1), self.tp_group)
        return out.sub_(sums.log()[:, None])

    # --------------------------------------------------------------- per-form finishing
    def finish_chunk_topk(self, mean: torch.Tensor) -> dict[str, torch.Tensor]:
        k = self.spec.width
        vals, idx = mean.topk(min(k, self.num_real), dim=1)
        top_v, top_i = _merge_topk(vals, idx + self.vocab_start, k, self.tp_group)
        local = (top_i >= self.vocab_start) & (top_i < self.vocab_start + self.num_real)
        rest = mean.clone()
        rows = torch.arange(mean.shape[0], device=self.dev)[:, None].expand_as(top_i)
        rest[rows[local], top_i[local] - self.vocab_start] = float("-inf")
        tail = all_reduce(rest.exp().sum(1), self.tp_group)
        return {"logprobs": top_v, "columns": top_i, "tail_logprob": tail.clamp_min(TINY).log()}

    def _gold_parts(self, mean: torch.Tensor, pairs: int, n: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the chunk-mean log-probs on the ``pairs`` common pairs, the ``n`` largest uncommon
        probabilities, descending), each over all of V_t (TP-reduced)."""
        rows = mean.shape[0]
        common = mean.new_zeros(rows, pairs)
        common[:, self.pair_local] = mean[:, self.col_common]
        all_reduce(common, self.tp_group)
        rest = mean.clone()
        rest[:, self.col_common] = float("-inf")
        vals, idx = rest.topk(min(n, self.num_real), dim=1)
        top_v, _ = _merge_topk(vals, idx, n, self.tp_group)
        return common, top_v.exp()

    def finish_gold(self, mean: torch.Tensor) -> dict[str, torch.Tensor]:
        common, probs = self._gold_parts(mean, self.spec.width, self.spec.uncommon)
        return {"logprobs": common, "uncommon_probs": probs}

    def finish_gold_topk(self, mean: torch.Tensor) -> dict[str, torch.Tensor]:
        """Compact gold (:func:`definitions.formulas.gold_topk_teacher`) from the gold parts."""
        spec = self.spec
        common, probs = self._gold_parts(mean, spec.pairs, spec.span)
        b_top, cols, rest, t_head, t_tail = gold_topk_teacher(common, probs, spec.width,
                                                              spec.uncommon)
        return {"logprobs": b_top, "columns": cols, "tail_logprob": rest,
                "uncommon_probs": t_head, "uncommon_tail": t_tail}

    def finish_image(self, mean: torch.Tensor) -> dict[str, torch.Tensor]:
        """P = exp(mean) on W's image, the float64 sums of P log P over all of V_t (0 log 0 =
        0) and of P over the columns outside I, and the first argmax over all of V_t."""
        rows = mean.shape[0]
        shipped = mean.to(torch.float32)  # what a full payload would hold: the same sums
        on_image = shipped.new_zeros(rows, self.spec.width)
        on_image[:, self.pair_local] = shipped[:, self.col_common].exp()
        all_reduce(on_image, self.tp_group)
        if exact_rows.supported(shipped):  # CPU: one Numba pass a row
            sums, at = exact_rows.image_sums(shipped, self.outside)
        else:
            p = shipped.exp()
            sums = torch.stack([torch.sum(p * shipped.clamp_min(-1e30), 1, dtype=torch.float64),
                                torch.sum(p * self.outside, 1, dtype=torch.float64)], dim=1)
            at = shipped.argmax(1) if self.num_real else torch.zeros(
                rows, dtype=torch.int64, device=self.dev)  # the first maximum of this shard
        all_reduce(sums, self.tp_group)
        if self.num_real:
            best = shipped.gather(1, at[:, None])[:, 0]
        else:
            best = shipped.new_full((rows,), float("-inf"))
        values = torch.cat(all_gather(best[:, None].contiguous(), self.tp_group), 1)
        ids = torch.cat(all_gather((at + self.vocab_start)[:, None].contiguous(), self.tp_group), 1)
        first = values.argmax(1, keepdim=True)  # shards in vocabulary order: the lowest id wins
        return {"probs": on_image, "sums": float64_as_pair(sums).reshape(rows, 4),
                "teacher_argmax": ids.gather(1, first)[:, 0]}

    def finish_full(self, mean: torch.Tensor) -> dict[str, torch.Tensor]:
        width = self.logits2d.shape[1]
        padded = mean.new_zeros(mean.shape[0], width)
        padded[:, : self.num_real] = mean
        full = torch.cat(all_gather(padded, self.tp_group), 1)[:, : self.spec.width]
        return {"logprobs": full}


def teacher_payload(
    logits: torch.Tensor,
    pred_chunk_id: torch.Tensor,
    spec: PayloadSpec,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    common_teacher_ids: torch.Tensor | None = None,
    image_teacher_ids: torch.Tensor | None = None,
    tp_group: Group = None,
    cp_group: Group = None,
    block_bytes: int = BLOCK_BYTES,
) -> TeacherPayload:
    """The payload of one teacher microbatch (identical on every TP/CP rank of the replica).

    ``logits`` [B, T_local, V_local]; ``pred_chunk_id`` [B, T_local] (predicting chunk ids,
    -1 none, slots < ``spec.num_chunks``); ``vocab_size``: the real teacher vocabulary V_t;
    ``common_teacher_ids``: the teacher side of the common pairs (gold forms);
    ``image_teacher_ids``: W's image, ascending (image form,
    :func:`kernels.image_projection.teacher_image`).
    """
    if logits.dim() != 3 or pred_chunk_id.shape != logits.shape[:2]:
        raise ValueError(f"teacher logits [B, T, V] {tuple(logits.shape)} and chunk ids "
                         f"{tuple(pred_chunk_id.shape)} disagree")
    if not logits.is_contiguous():
        logits = logits.contiguous()
    ids = image_teacher_ids if spec.form == "image" else common_teacher_ids
    t = _Teacher(logits, spec, vocab_size, temperature, ids, tp_group, cp_group)
    rows = build_chunk_rows(pred_chunk_id, spec.num_chunks, None, cp_group,
                            max(1, block_bytes // (4 * max(logits.shape[-1], 1))))
    columns = None
    if spec.form == "topk":
        columns = _microbatch_topk(t, spec.width, pred_chunk_id.reshape(-1) >= 0)
    finish = {"full": t.finish_full, "chunk_topk": t.finish_chunk_topk,
              "gold": t.finish_gold, "gold_topk": t.finish_gold_topk,
              "image": t.finish_image, "topk": None}[spec.form]
    per_block = spec.form in ("chunk_topk", "gold", "gold_topk", "image")

    done_rows, done_vals, sums = [], [], []
    split_buf = None
    for blk in rows.blocks:
        if blk.row_end == blk.row_start:
            continue
        if spec.form == "topk":
            values = _columns_log_softmax(t, blk.start, blk.end, columns)
        else:
            values = t.log_softmax(t.x(blk.start, blk.end))
        seg = rows.pos_row[blk.start: blk.end].to(t.dev)
        seg = torch.where(seg >= 0, seg - blk.row_start, blk.row_end - blk.row_start)
        raw = values.new_zeros(blk.row_end - blk.row_start + 1, values.shape[1])
        raw = raw.index_add_(0, seg, values)[:-1]
        split_buf = _stash_split(rows, blk.row_start, blk.row_end, raw, split_buf)
        local = torch.nonzero(rows.split_slot[blk.row_start: blk.row_end] < 0, as_tuple=True)[0]
        if per_block:
            if local.numel():
                mean = raw[local.to(t.dev)] / rows.count[blk.row_start + local].to(raw)[:, None]
                done_rows.append(blk.row_start + local)
                done_vals.append(finish(mean))
        else:
            sums.append(raw)
    if not per_block and sums:
        raw_all = torch.cat(sums)
        local = rows.local_rows
        mean = raw_all[local.to(t.dev)] / rows.count[local].to(raw_all)[:, None]
        done_rows.append(local)
        done_vals.append({"logprobs": mean} if finish is None else finish(mean))
    split_vals = _finish_split(t, rows, split_buf, finish, spec)
    return _assemble(t, rows, spec, done_rows, done_vals, split_vals, columns,
                     pred_chunk_id.shape[0])


def _microbatch_topk(t: _Teacher, k: int, predicting: torch.Tensor) -> torch.Tensor:
    """NeMo-RL ``vocab_topk``: the k columns with the largest logit anywhere in the microbatch,
    over the positions that predict a chunk (``predicting`` [rows]): padding never chooses a
    column, so the set does not depend on how much of it a forward runs."""
    importance = torch.full((t.num_real,), float("-inf"), device=t.dev)
    if t.num_real:
        rows = torch.nonzero(predicting.to(t.dev), as_tuple=True)[0]
        for part in rows.split(max(1, BLOCK_BYTES // (4 * t.num_real))):
            importance = torch.maximum(importance,
                                       t.logits2d[part, : t.num_real].amax(0).float())
    all_reduce(importance, t.cp_group, "max")
    vals, idx = importance[None].topk(min(k, t.num_real), dim=1)
    _, top = _merge_topk(vals, idx + t.vocab_start, k, t.tp_group)
    return top[0].sort().values


def _columns_log_softmax(t: _Teacher, start: int, end: int, columns: torch.Tensor
                         ) -> torch.Tensor:
    """log_softmax of logits / T restricted to teacher ``columns`` (each on one TP rank)."""
    local = (columns >= t.vocab_start) & (columns < t.vocab_start + t.num_real)
    slot = torch.nonzero(local, as_tuple=True)[0]
    vals = torch.zeros(end - start, columns.numel(), device=t.dev)
    vals[:, slot] = t.logits2d[start:end, columns[slot] - t.vocab_start].float()
    all_reduce(vals, t.tp_group)
    return torch.log_softmax(vals / t.temp, dim=1)


def _stash_split(rows: ChunkRows, lo: int, hi: int, raw: torch.Tensor, buf):
    if rows.split_keys.numel() == 0:
        return None
    if buf is None:
        buf = raw.new_zeros(rows.split_keys.numel(), raw.shape[1])
    slot = rows.split_slot[lo:hi]
    sel = torch.nonzero(slot >= 0, as_tuple=True)[0]
    if sel.numel():
        buf[slot[sel].to(buf.device)] = raw[sel.to(buf.device)]
    return buf


def _finish_split(t: _Teacher, rows: ChunkRows, buf, finish, spec: PayloadSpec):
    n = rows.split_keys.numel()
    if n == 0:
        return None
    if buf is None:
        width = spec.width if spec.form == "topk" else t.num_real
        buf = torch.zeros(n, width, device=t.dev)
    all_reduce(buf, t.cp_group)
    mean = buf / rows.key_count[rows.split_keys].to(buf)[:, None]
    return {"logprobs": mean} if finish is None else finish(mean)


def _assemble(t: _Teacher, rows: ChunkRows, spec: PayloadSpec, done_rows, done_vals,
              split_vals, columns, batch: int) -> TeacherPayload:
    """Scatter every chunk's values (from its owning CP rank) and replicate them over CP."""
    slots = batch * spec.num_chunks
    out: dict[str, torch.Tensor] = {}
    for name, shape in spec._parts():  # the payload's own parts, [num_chunks, ...] a sample
        if name == "has_teacher" or (spec.form == "topk" and name == "columns"):
            continue  # made below: from the keys; the microbatch's columns, one row a sample
        dtype = torch.int64 if name in ("columns", "teacher_argmax") else torch.float32
        buf = torch.zeros(slots, *shape[1:], dtype=dtype, device=t.dev)
        for r, vals in zip(done_rows, done_vals):
            buf[rows.keys[r].to(t.dev)] = vals[name].to(dtype)
        if split_vals is not None:
            mine = rows.split_owner == group_rank(t.cp_group)
            buf[rows.split_keys[mine].to(t.dev)] = split_vals[name][mine.to(t.dev)].to(dtype)
        all_reduce(buf, t.cp_group)
        out[name] = buf.view(batch, *shape)
    if spec.form == "topk":
        out["columns"] = columns.expand(batch, -1).contiguous()
    has = (rows.key_count > 0).view(batch, spec.num_chunks).to(t.dev)
    return TeacherPayload.of_parts(spec, {"has_teacher": has, **out})
