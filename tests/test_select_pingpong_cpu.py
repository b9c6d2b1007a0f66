"""CPU checks of the selection's MMA ping-pong (``SelectSm90(pingpong=True)``, issue 15, Option B
of docs/reviews/2026-12-01-fp8-selection-epilogue.md; ``select_sm90``'s module docstring, "MMA
ping-pong"). Its numerics are tested on the GPU (bitwise the default's indices:
tests/test_gpu_cute.py, tests/test_gpu_cute_fp8.py); here:

- the field is part of the kernel's identity (equality, hash, the disk cache's key: a variant
  never loads the default's binary), while the default's ``repr`` (the compiled kernel's name)
  is the text it had before the field existed;
- the PTX (sm_90a, the fp8 paper kernel and the query-map kernel, whose named barrier 1 runs
  before the loop), read in file order: the counts of ``bar.sync`` / ``bar.arrive`` on ids 2 and
  3 (256 threads) of the docstring's accounting; ``mma_turn_first`` as the second warpgroup's
  lone ``bar.arrive 2`` (the warpgroup index: the register whose ``!= 0`` leads to the
  consumers' ``setmaxnreg.inc``); at each issue site (one before the key loop, one in it) the
  branch on ``index != 2`` whose fall-through (the second warpgroup) holds ``bar.sync 3`` and
  whose target (the first) ``bar.sync 2``, then ``wgmma.fence``; after ``wgmma.commit_group``
  the target's ``bar.arrive 3`` and the fall-through's ``setp.eq x, c`` branching past its
  ``bar.arrive 2``; that ``x == c`` is ``N == 1`` before the loop and ``j + 2 == N`` at loop
  step j (x followed as an affine form through ``add/sub/neg/not/mov`` and the loop's
  induction steps; N from the loop's zero-trip test), and the loop's issue is behind
  ``j + 1 < N``. Each of three broken kernels fails it (they pass counts and sorted sets):
  ``mma_turn_wait``'s ids swapped, ``mma_turn_pass``'s ``if last:``, the loop's skip at
  ``j + 1 == N``. The default kernel has none of ids 2 and 3;
- the accounting itself, replayed: the two warpgroups' barrier operations (a hand-written copy
  of the design, see ``_program``) for ``n_tiles`` 1, 2, 3 and 5, every interleaving, on a
  model of a hardware named barrier (a phase completes at 256 threads, waiting or arriving):
  no deadlock, the MMAs issued alternately, no arrival pending at the end; without the
  last-issue skip one stays pending.

CPU time on the 2-core machine (``--durations=0``, two runs at load average 2.9-3.4 from other
jobs): 7.8-7.9 s of test time (the compiles: qmap 4.6 s, fp8 variant + default 2.2 s; the
replay 0.9 s; reading the PTX < 0.1 s), 8.5-8.6 s in pytest, 12.4-12.9 s wall with pytest's
start and imports.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import pytest

cutlass = pytest.importorskip("cutlass")

PAPER_FP8 = "e4m3", 128, 4, 1, 16, 128  # dtype, Dp, Hp, Hpk, top_k, block (paper / anchor)
SYNC = re.compile(r"\bbar\.sync\s+(\d+)(?:,\s*(\d+))?;")
ARRIVE = re.compile(r"\bbar\.arrive\s+(\d+),\s*(\d+);")


def test_pingpong_is_part_of_the_kernel_identity():
    from cutlass import BFloat16, Float8E4M3FN

    from flash_msa.cute import disk_cache
    from flash_msa.cute.select_sm90 import SelectSm90

    for kernel in (
        SelectSm90(BFloat16, 128, 4, 1, 16, 128),
        SelectSm90(BFloat16, 128, 4, 1, 64, 64, qmap=True),
        SelectSm90(Float8E4M3FN, 128, 4, 1, 16, 128, 8, key_scale="block"),
    ):
        variant = dataclasses.replace(kernel, pingpong=True)
        assert variant != kernel and hash(variant) != hash(kernel)
        assert len({kernel, variant}) == 2  # the in-process compile cache's keys
        assert disk_cache.stable_text(variant) != disk_cache.stable_text(kernel)
        assert variant == dataclasses.replace(kernel, pingpong=True)
        # the default's text (the DSL's kernel name) has no trace of the field
        assert "pingpong" not in repr(kernel) and "pingpong=True" in repr(variant)
        assert repr(variant).replace(", pingpong=True", "") == repr(kernel)
    with pytest.raises(TypeError, match="pingpong"):
        SelectSm90(BFloat16, 128, 4, 1, 16, 128, pingpong=1)


def _ptx(tmp_path, name, *cfg, **kw) -> str:
    from flash_msa.cute.select_sm90 import compile_select

    res = compile_select(*cfg, dump=str(tmp_path), name=name, **kw)
    assert res["stack"] == 0 and res["local"] == 0, res
    return (tmp_path / f"{name}.ptx").read_text()


def _bars(lines):
    """``(kind, id, threads)`` of every ``bar.sync`` / ``bar.arrive`` among ``lines``."""
    out = []
    for line in lines:
        if m := SYNC.search(line):
            out.append(("sync", int(m[1]), int(m[2]) if m[2] else None))
        elif m := ARRIVE.search(line):
            out.append(("arrive", int(m[1]), int(m[2])))
    return out


# ---------------------------------------------------------------------------------------------
# the PTX read as code: each turn's branches in file order, and what their conditions compare
# ---------------------------------------------------------------------------------------------
def _code(text):
    """The PTX's instructions and labels as ``(line number, text)``, whitespace collapsed; no
    comments, blank lines, braces or ``.reg`` lines of inline asm, pragmas."""
    code = []
    for i, line in enumerate(text.splitlines()):
        line = " ".join(line.split("//")[0].split())
        if line and line not in "{}" and not line.startswith((".pragma", ".reg")):
            code.append((i, line))
    return code


def _edge(t):
    """Whether instruction ``t`` ends or starts a basic block (a label or a branch)."""
    return t.endswith(":") or re.search(r"\bbra\b", t) is not None


def _after_label(code, label):
    """The instruction right after ``label:``."""
    return code[[t for _, t in code].index(label + ":") + 1][1]


def _key_loop(code):
    """``(head, latch)``: the positions in ``code`` of the consumers' key loop's label and of
    its backward branch (the one whose target precedes the loop's ``wgmma.wait_group``: the MMA
    of tile j waited for)."""
    labels = {t[:-1]: k for k, (_, t) in enumerate(code) if t.endswith(":")}
    wait = next(k for k, (_, t) in enumerate(code) if t.startswith("wgmma.wait_group"))
    loops = []
    for k, (_, t) in enumerate(code):
        m = re.fullmatch(r"(?:@%p\d+ )?bra(?:\.uni)? (\$L__\w+);", t)
        if m and labels.get(m[1], k) < wait < k:
            loops.append((labels[m[1]], k))
    assert len(loops) == 1, loops
    return loops[0]


def _plus(a, b, scale=1):
    """The affine form ``a + scale * b`` (zero coefficients dropped: equal forms compare
    equal)."""
    out = dict(a)
    for s, c in b.items():
        out[s] = out.get(s, 0) + scale * c
    return {s: c for s, c in out.items() if c}


def _value(code, loop, x, at, carried=None):
    """Operand ``x`` (an immediate or a register) at position ``at`` of ``code`` as an affine
    form ``{symbol: coefficient}``: symbols ``1`` (the constant), ``"j"`` (the key loop's step,
    from 0) and leaves (a special register such as ``%ctaid.y``, or ``"%r<n>@<line>"`` for a
    definition this does not follow). Follows ``add/sub/neg/not/mov`` on 32 bits through a
    register's last definition before ``at``. In the key loop, a register whose one definition
    there lies past ``at`` holds the previous step's value: it must grow by a constant ``s``
    per step (``carried``: the register whose step is being computed, its value at the loop's
    head) and be redefined on every path (in the loop's first or last block, as LLVM places
    induction variables and their copies); it is its value entering the loop + ``s * j``."""
    if re.fullmatch(r"-?\d+", x):
        return {1: int(x)}
    if not re.fullmatch(r"%r\d+", x):
        return {x: 1}
    head, latch = loop
    defs = []
    for k, (_, t) in enumerate(code):
        m = re.match(r"(@!?%p\d+ )?\S+ (\{[^}]*\}|%[\w|%]+)", t)
        if m and x in re.findall(r"%\w+", m[2]):
            assert not m[1], f"{x} defined under a predicate: {t}"
            defs.append(k)
    inside = [k for k in defs if head < k < latch]
    if inside and head < at <= inside[-1]:
        if x == carried:
            return {x: 1}
        assert len(inside) == 1, [code[k] for k in inside]
        k = inside[0]
        step = _plus(_defined(code, loop, x, k, carried=x), {x: 1}, -1)
        assert set(step) == {1}, f"the key loop changes {x} by {step}: {code[k]}"
        in_first = not any(_edge(t) for _, t in code[head + 1 : k])
        assert in_first or not any(_edge(t) for _, t in code[k + 1 : latch]), code[k]
        return _plus(_value(code, loop, x, head), {"j": step[1]})
    return _defined(code, loop, x, max(k for k in defs if k < at), carried)


def _defined(code, loop, x, k, carried=None):
    """The value instruction ``code[k]`` writes to register ``x`` (:func:`_value`)."""
    m = re.fullmatch(rf"(add|sub|neg|not|mov)\.[bsu]32 {x}, ([^,]+)(?:, ([^,]+))?;", code[k][1])
    if not m:
        return {f"{x}@{code[k][0]}": 1}
    a = _value(code, loop, m[2], k, carried)
    if m[1] in ("add", "sub"):
        return _plus(a, _value(code, loop, m[3], k, carried), 1 if m[1] == "add" else -1)
    if m[1] == "neg":
        return _plus({}, a, -1)
    if m[1] == "not":  # ~a = -a - 1
        return _plus({1: -1}, a, -1)
    return a


def _show(form, N):
    """Affine ``form`` as text, in terms of ``N`` where it is ``a*j + b*N + c``."""
    for b in (1, -1, 0):
        rest = _plus(form, N, -b)
        if set(rest) <= {"j", 1}:
            terms = [(rest.get("j", 0), "j"), (b, "N"), (rest.get(1, 0), "")]
            text = "".join(
                f" {'-' if c < 0 else '+'} {abs(c) if abs(c) != 1 or not v else ''}{v}"
                for c, v in terms
                if c
            )
            return (text[3:] if text[1] == "+" else "-" + text[3:]) if text else "0"
    return str(form)


def _setp(code, pred, at):
    """``(comparison, a, b, position)`` of the last ``setp.<cmp>.<type> pred, a, b`` before
    position ``at``."""
    k = max(k for k, (_, t) in enumerate(code[:at]) if t.startswith("setp.") and f" {pred}," in t)
    m = re.fullmatch(rf"setp\.(\w+)\.[bsu]32 {pred}, (%r\d+), (-?\d+|%r\d+);", code[k][1])
    assert m, code[k]
    return m[1], m[2], m[3], k


# The turns as the PTX has them, in file order (comments dropped: _code). `%p` is
# `setp.ne.b32 %p, WG, 2` (WG the warpgroup index: 1 the first consumer warpgroup, 2 the
# second): the branch target is the first warpgroup's code, the fall-through the second's.
TURN_FIRST = (  # mma_turn_first: the second warpgroup alone arrives on barrier 2
    r"setp\.ne\.b32 (?P<p>%p\d+), (?P<wg>%r\d+), 2;\n@(?P=p) bra (?P<t>\$L__\w+);\n"
    r"bar\.arrive 2, 256;\n(?P=t):\n"
)
TURN_WAIT = (  # mma_turn_wait: the second waits on barrier 3, the first on 2, both then issue
    r"@(?P<p>%p\d+) bra (?P<t>\$L__\w+);\nbar\.sync 3, 256;\nbra\.uni (?P<j>\$L__\w+);\n"
    r"(?P=t):\nbar\.sync 2, 256;\n(?P=j):\n(?:setp\.ne\.b32 %p\d+, %r\d+, 2;\n)?"
    r"wgmma\.fence\.sync\.aligned;\Z"
)
TURN_PASS = (  # mma_turn_pass: the first hands over on barrier 3, the second on 2 unless x == c
    r"\Awgmma\.commit_group\.sync\.aligned;\n@(?P<p>%p\d+) bra (?P<t>\$L__\w+);\n"
    r"setp\.eq\.b32 (?P<q>%p\d+), (?P<x>%r\d+), (?P<c>-?\d+);\n@(?P=q) bra (?P<j>\$L__\w+);\n"
    r"bar\.arrive 2, 256;\nbra\.uni (?P=j);\n(?P=t):\nbar\.arrive 3, 256;\n(?P=j):"
)


@pytest.mark.parametrize("mode", ["fp8", "qmap"])
def test_pingpong_ptx_has_the_accounting_barriers(tmp_path, mode):
    """The variant's named barriers as many as the module docstring's accounting says, and at
    each issue site (before the key loop, in it) in file order: which warpgroup waits and
    arrives on which barrier, and the second's skip of its last hand-over taken exactly at
    ``N == 1`` (before the loop) and ``j + 2 == N`` (step j), the loop's issue behind
    ``j + 1 < N``; the default kernel (fp8) has none of ids 2 and 3."""
    if mode == "fp8":
        cfg, kw = PAPER_FP8, dict(key_scale="block")
    else:  # the query map: its barrier 1 (256 threads) before the loop stays as it was
        cfg, kw = ("bf16", 128, 4, 1, 64, 64), dict(qmap=True)
    text = _ptx(tmp_path, "pingpong", *cfg, pingpong=True, **kw)
    bars = _bars(text.splitlines())
    turns = [b for b in bars if b[1] in (2, 3)]
    assert all(t == 256 for _, _, t in turns), turns
    count = Counter(b[:2] for b in turns)
    # per issue site (before the loop, in it) one bar.sync per warpgroup and one bar.arrive per
    # warpgroup (the second's behind its last-issue skip); plus the second's first hand-over
    assert count == {("sync", 2): 2, ("sync", 3): 2, ("arrive", 2): 3, ("arrive", 3): 2}, count
    others = sorted({b for b in bars if b[1] not in (2, 3)})
    assert others == ([("sync", 0, None)] + ([("sync", 1, 256)] if mode == "qmap" else []))

    code = _code(text)
    loop = head, latch = _key_loop(code)
    fences = [k for k, (_, t) in enumerate(code) if t.startswith("wgmma.fence")]
    commits = [k for k, (_, t) in enumerate(code) if t.startswith("wgmma.commit_group")]
    assert len(fences) == len(commits) == 2 and fences[0] < head < fences[1] < latch

    def window(k, before=0, after=0):
        return "\n".join(t for _, t in code[max(k - before, 0) : k + after + 1]) + "\n"

    # WG: the register whose `!= 0` sends a warpgroup to the consumers' setmaxnreg.inc
    consumers = {
        m[2]
        for k, (_, t) in enumerate(code[:head])
        if (m := re.fullmatch(r"setp\.ne\.b32 (%p\d+), (%r\d+), 0;", t))
        and (b := re.fullmatch(rf"@{m[1]} bra (\$L__\w+);", code[k + 1][1]))
        and _after_label(code, b[1]).startswith("setmaxnreg.inc")
    }
    assert len(consumers) == 1, consumers
    wg = consumers.pop()
    # N: the loop's zero-trip test, `N < 1` as `R < c0` (R = N - 1 + c0) branching past it
    past = code[latch + 1][1]
    zero_trip = [k for k in range(head) if code[k][1].endswith(f" bra {past[:-1]};")]
    assert len(zero_trip) == 1 and past.endswith(":"), [code[k] for k in zero_trip]
    cmp, r, c0, k = _setp(code, code[zero_trip[0]][1].split()[0][1:], zero_trip[0])
    assert cmp == "lt" and re.fullmatch(r"-?\d+", c0), code[k]
    N = _plus(_value(code, loop, r, k), {1: 1 - int(c0)})

    firsts = list(re.finditer(TURN_FIRST, window(fences[0], before=fences[0])))
    assert len(firsts) == 1 and firsts[0]["wg"] == wg, firsts
    for site, (f, c) in enumerate(zip(fences, commits)):
        wait = re.search(TURN_WAIT, window(f, before=7)[:-1])
        assert wait, f"site {site}: the wait for the turn is not TURN_WAIT:\n{window(f, 7)}"
        turn = re.match(TURN_PASS, window(c, after=8))
        assert turn, f"site {site}: the hand-over is not TURN_PASS:\n{window(c, after=8)}"
        for p, at in ((wait["p"], f), (turn["p"], c)):
            assert _setp(code, p, at)[:3] == ("ne", wg, "2"), (site, p)
        # the second warpgroup's skip of its last hand-over: x == c exactly when this issue is
        # its last (an affine x - c that is zero there and nowhere else)
        skip = _plus(_value(code, loop, turn["x"], c), {1: -int(turn["c"])})
        last = _plus({1: -1}, N) if site == 0 else _plus({"j": 1, 1: 2}, N, -1)
        assert skip in (last, _plus({}, last, -1)), (
            f"site {site}: the skip `{turn['x']} == {turn['c']}` tests {_show(skip, N)} == 0, "
            f"the last issue is at {_show(last, N)} == 0"
        )
        if site == 1:  # the loop's issue behind `j + 1 < N`: its `>=` branches past both turns
            guard = max(k for k in range(head, f) if code[k][1].endswith(f" bra {turn['j']};"))
            cmp, y, z, k = _setp(code, code[guard][1].split()[0][1:], guard)
            diff = _plus(_value(code, loop, y, k), _value(code, loop, z, k), -1)
            assert cmp == "ge" and diff == _plus({"j": 1, 1: 1}, N, -1), (code[k], _show(diff, N))
    if mode == "fp8":
        default = _ptx(tmp_path, "default", *cfg, **kw)
        assert not [b for b in _bars(default.splitlines()) if b[1] in (2, 3)]
        assert "pingpong" not in default


# ---------------------------------------------------------------------------------------------
# the accounting, replayed on a model of the hardware barriers
# ---------------------------------------------------------------------------------------------
def _program(w, n_tiles, skip_last=True):
    """Consumer warpgroup ``w``'s operations in the kernel's order: ``("arrive"|"sync", id)``
    and ``("mma", j)`` (``mma_turn_first``, then per issue ``mma_turn_wait``, the MMA,
    ``mma_turn_pass``).

    A hand-written copy of the module docstring's design, not derived from the kernel: the PTX
    test is what ties the kernel's barriers and skip conditions to it. It leaves out the
    producer's key ring (a warpgroup's wait for tile j's full barrier, its release of the
    stage): the replay shows the turns alone cannot deadlock or leave an arrival pending; that
    the ring's waits add no cycle is the docstring's argument (and the GPU tests at
    ``stages`` 2 and 3), not checked here."""
    mine, other = (2, 3) if w == 0 else (3, 2)
    ops = [("arrive", 2)] if w == 1 else []
    for j in range(n_tiles):  # the issue of tile j (before the loop, then at loop step j - 1)
        ops += [("sync", mine), ("mma", j)]
        if not (w == 1 and skip_last and j == n_tiles - 1):
            ops.append(("arrive", other))
    return ops


def _replay(n_tiles, skip_last=True):
    """Every interleaving of the two programs on hardware-like named barriers (a phase
    completes when its waiting and arriving warpgroups make 256 threads; a phase completed by
    arrivals alone releases no one). Returns the set of ``(mma order, pending per barrier)``
    of the interleavings that finish; raises on a deadlock."""
    progs = [_program(0, n_tiles, skip_last), _program(1, n_tiles, skip_last)]
    ends = set()

    def run(pc, count, waiting, order):
        moved = False
        for w in (0, 1):
            if waiting[w] is not None or pc[w] == len(progs[w]):
                continue
            kind, x = progs[w][pc[w]]
            pc2, count2, waiting2 = list(pc), dict(count), list(waiting)
            pc2[w] += 1
            order2 = order + ((w, x),) if kind == "mma" else order
            if kind != "mma":
                count2[x] += 128
                if kind == "sync":
                    waiting2[w] = x
                if count2[x] == 256:  # the phase completes: its waiters go on
                    count2[x] = 0
                    waiting2 = [None if b == x else b for b in waiting2]
            run(tuple(pc2), count2, tuple(waiting2), order2)
            moved = True
        if not moved:
            assert waiting == (None, None), f"deadlock at {pc}, waiting on {waiting}"
            ends.add((order, tuple(sorted(count.items()))))

    run((0, 0), {2: 0, 3: 0}, (None, None), ())
    return ends


@pytest.mark.parametrize("n_tiles", [1, 2, 3, 5])
def test_pingpong_accounting_alternates_and_leaves_nothing_pending(n_tiles):
    ends = _replay(n_tiles)
    alternate = tuple((w, j) for j in range(n_tiles) for w in (0, 1))
    assert ends == {(alternate, ((2, 0), (3, 0)))}
    # without the skip of the second warpgroup's last hand-over, one arrival outlives the loop
    # on barrier 2 (its next sync there would pass without the other warpgroup)
    assert {pending for _, pending in _replay(n_tiles, skip_last=False)} == {((2, 128), (3, 0))}
