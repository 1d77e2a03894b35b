"""The zero-bubble grids (jaxpar.layers.zero_bubble) against the paper's slot counts and against a check of
their dependencies written here: every pass once, after the passes it needs, one pass per stage and slot."""

import pytest

from jaxpar.layers.zero_bubble import KINDS, idle_fraction, in_flight, schedule_zero_bubble


def check_grid(kind: str, grid, stages: int, microbatches: int) -> dict:
    """The slot of every pass (kind, microbatch, chunk), after checking the grid: each stage runs at most one
    pass per slot, on chunks it holds, every pass of every chunk once, each after what it needs."""
    n = stages if kind == "zb_h1" else 2 * stages
    at = {}
    for s, row in enumerate(grid):
        for t, cell in enumerate(row):
            assert len(cell) <= 1, (s, t, cell)
            for p, m, r in cell:
                c = s if r == 0 else 2 * stages - 1 - s  # zb_v: the second chunk of stage s is on the way up
                assert r == 0 or kind == "zb_v", cell
                assert (p, m, c) not in at, (p, m, c)
                at[(p, m, c)] = t
    assert set(at) == {(p, m, c) for p in "FBW" for m in range(microbatches) for c in range(n)}
    for (p, m, c), t in at.items():
        if p == "F" and c > 0:
            assert at[("F", m, c - 1)] < t  # the previous chunk's output, shifted between slots
        if p == "B":
            assert at[("F", m, c)] < t
            if c < n - 1:
                assert at[("B", m, c + 1)] < t  # the next chunk's input cotangent
        if p == "W":
            assert at[("B", m, c)] < t
    return at


def test_idle_fractions_at_four_stages_and_eight_microbatches():
    """Issue 37's acceptance: at S = 4, M = 8, ZB-H1 idles at most half of 1F1B's share and ZB-V at most a
    quarter. 1F1B in the same slots (F, and B + W as one pass of two slots): 3M + 3(S - 1) slots, of which
    each stage idles 3(S - 1), a share of (S-1)/(M+S-1)."""
    s_, m_ = 4, 8
    one_f_one_b = (s_ - 1) / (m_ + s_ - 1)
    for kind, bound in (("zb_h1", 1 / 2), ("zb_v", 1 / 4)):
        grid = schedule_zero_bubble(kind, s_, m_)
        check_grid(kind, grid, s_, m_)
        print(f"\n{kind}: {len(grid[0])} slots, idle {idle_fraction(grid):.3f} (1F1B {one_f_one_b:.3f})")
        for row in grid:
            print(" ".join(f"{c[0][0]}{c[0][1]}{chr(39) if c[0][2] else ' '}" if c else ".  " for c in row))
        assert idle_fraction(grid) <= bound * one_f_one_b


@pytest.mark.parametrize("stages", [2, 3, 4, 5, 8])
def test_slots_and_memory_are_the_papers(stages):
    """ZB-H1 takes 3M + S - 1 slots (the paper's bubble (S-1)(T_F + T_B - T_W) at equal times); ZB-V 6M + S - 1
    slots of a chunk's pass where M is a multiple of S (the last device's S - 1 slots before its first input
    are its only idle ones; one slot more at S = 5, M > S), never more than 1F1B's 6M + 6(S - 1). Both hold
    at most 1F1B's peak of S stage inputs (ZB-V: 2S chunk inputs, each half a stage's) from a microbatch's F
    to its W."""
    for m_ in (stages, stages + 1, 2 * stages, 4 * stages):
        h1, v = (schedule_zero_bubble(k, stages, m_) for k in KINDS)
        check_grid("zb_h1", h1, stages, m_)
        check_grid("zb_v", v, stages, m_)
        assert len(h1[0]) == 3 * m_ + stages - 1
        assert max(in_flight(h1)) == stages
        assert max(in_flight(v)) <= 2 * stages
        assert 6 * m_ + stages - 1 <= len(v[0]) < 6 * m_ + 6 * (stages - 1)
        if m_ % stages == 0:
            assert len(v[0]) - (6 * m_ + stages - 1) in ((0, 1) if stages == 5 else (0,)), (stages, m_, len(v[0]))


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="'zb_x': choose one of zb_h1, zb_v"):
        schedule_zero_bubble("zb_x", 4, 8)
    with pytest.raises(ValueError, match="microbatches >= stages; got stages=4, microbatches=3"):
        schedule_zero_bubble("zb_v", 4, 3)
