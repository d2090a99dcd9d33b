"""The cpu kernel's scalar numerics, called directly: its float16 / bfloat16 conversions against
numpy's float16 and ml_dtypes' bfloat16 over dense sets of bit patterns (every exponent, every
rounding tie and its neighbours, subnormals, overflow, infinities, NaNs, -0), and its vector exp
and tanh against float64, in ulps. The kernel exports them for these tests only
(``rankattn_test_*`` in cpu_attention.cc), called through ctypes from the loaded library.
"""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np

from conftest import needs_cpu_kernel
from rankattn.backends import cpu

pytestmark = needs_cpu_kernel


def kernel(name: str, x: np.ndarray, out_dtype) -> np.ndarray:
    """rankattn_test_<name>(x, y, n) of the loaded kernel."""
    x = np.ascontiguousarray(x)
    y = np.empty(x.shape, out_dtype)
    getattr(cpu.library().handle, f"rankattn_test_{name}")(
        x.ctypes.data_as(ctypes.c_void_p), y.ctypes.data_as(ctypes.c_void_p),
        ctypes.c_int64(x.size))
    return y


def floats(bits) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


def dense_float32(low_bits) -> np.ndarray:
    """Every float32 whose low 16 bits are one of ``low_bits``: each sign, exponent and high
    mantissa, with chosen low bits (ties and their neighbours), and 2^20 random patterns."""
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    chosen = (high[:, None] | np.asarray(low_bits, np.uint32)[None, :]).ravel()
    random = np.random.default_rng(0).integers(0, 1 << 32, 1 << 20, dtype=np.uint32)
    return floats(np.concatenate([chosen, random]))


def assert_same_bits(got: np.ndarray, want: np.ndarray, x: np.ndarray, nan_bits: int):
    """got == want bit for bit, except that a NaN result need only be a NaN of the same sign
    (payloads differ between converters)."""
    sign = np.uint16(0x8000)
    nan = (want & 0x7FFF) > nan_bits
    np.testing.assert_array_equal(got[nan] & sign, want[nan] & sign)
    assert ((got[nan] & 0x7FFF) > nan_bits).all(), x[nan][(got[nan] & 0x7FFF) <= nan_bits][:5]
    bad = ~nan & (got != want)
    assert not bad.any(), list(zip(x[bad][:5], got[bad][:5], want[bad][:5]))


def test_bfloat16_from_float32_rounds_to_nearest_even():
    # Low halves 0x8000 are ties: the even neighbour wins (0x7FFF / 0x8001 go down / up).
    x = dense_float32([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF])
    with np.errstate(invalid="ignore"):  # NaNs
        want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert_same_bits(kernel("bf16_from_f32", x, np.uint16), want, x, nan_bits=0x7F80)


def test_p_and_ds_round_to_bfloat16_like_the_scalar_conversion():
    """bf16_bits, the vector rounding of p and ds before their dots (never NaN): to nearest
    even, bit for bit, except that a build with AVX-512 BF16 (VCVTNEPS2BF16) takes float32
    denormals as zero of their sign; one rule or the other for every denormal."""
    x = dense_float32([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF])
    x = x[~np.isnan(x)]
    want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    got = kernel("bf16_bits", x, np.uint16)
    denormal = (x != 0) & (np.abs(x) < np.finfo(np.float32).tiny)
    np.testing.assert_array_equal(got[~denormal], want[~denormal])
    exact = got[denormal] == want[denormal]
    as_zero = got[denormal] == (want[denormal] & np.uint16(0x8000))
    if cpu.library().handle.rankattn_test_bf16_dots() == 0:  # no VCVTNEPS2BF16: the portable
        assert exact.all(), x[denormal][~exact][:5]          # rounding, denormals included
    else:
        assert exact.all() or as_zero.all(), x[denormal][~(exact | as_zero)][:5]


def test_float16_to_float32_is_exact_for_every_half():
    h = np.arange(1 << 16, dtype=np.uint16)
    want = h.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(kernel("f16_to_f32", h, np.float32).view(np.uint32),
                                  want.view(np.uint32))


def test_float16_from_float32_rounds_to_nearest_even():
    """Every half h, and around each midpoint between h and the next half: the midpoint (a tie,
    exact in float32 at every scale, subnormals included), one float32 ulp below and above;
    overflow to inf from 65520 on, -0, infinities, NaNs, and random patterns."""
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    finite = halves[np.isfinite(halves)].astype(np.float64)
    ordered = np.unique(finite)
    middles = ((ordered[:-1] + ordered[1:]) / 2).astype(np.float32)
    around = [np.nextafter(middles, -np.inf), middles, np.nextafter(middles, np.inf)]
    beyond = np.float32([65504, 65519.996, 65520, 65536, 1e6, 3.4e38, np.inf, 2.0**-25,
                         2.0**-26, 1e-45, 0.0])
    x = np.concatenate([finite.astype(np.float32), *around, beyond, -beyond,
                        dense_float32([0x0000, 0x0FFF, 0x1000, 0x1001, 0x2000])])
    with np.errstate(invalid="ignore", over="ignore"):  # NaNs, and overflow to inf
        want = x.astype(np.float16).view(np.uint16)
    assert_same_bits(kernel("f16_from_f32", x, np.uint16), want, x, nan_bits=0x7C00)


def ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| in units of the float32 spacing at want (float64 reference)."""
    spacing = np.spacing(want.astype(np.float32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - want) / spacing


# vexp's worst case, measured on every float in [-87.3, 88.3]: 1.01 ulp (FMA builds), 0.99
# without FMA (see its comment).
EXP_MAX_ULPS = 1.02


def test_exp_is_within_its_ulp_bound_over_its_whole_range():
    """Every 997th float32 bit pattern in [-87.3, 88.3] (every exponent, both signs), every
    float in [0.5, 1) and in [-1, -0.5), and the ends of the range."""
    x = floats(np.arange(0, 1 << 32, 997, dtype=np.uint64).astype(np.uint32))
    binade = np.arange(0x3F000000, 0x3F800000, dtype=np.uint32)
    ends = np.float32([-87.3, 88.3, np.nextafter(np.float32(-87.3), 0), 88.29])
    x = np.concatenate([x, floats(binade), floats(binade | 0x80000000), ends])
    x = x[(x >= np.float32(-87.3)) & (x <= np.float32(88.3))]
    got = kernel("exp", x, np.float32)
    err = ulps(got, np.exp(x.astype(np.float64)))
    assert err.max() <= EXP_MAX_ULPS, (err.max(), x[err.argmax()])


def test_exp_is_zero_below_the_cutoff_and_saturates_above_the_range():
    below = np.float32([-87.31, -88, -100, -1e30, -np.inf])
    np.testing.assert_array_equal(kernel("exp", below, np.float32), 0.0)
    top = kernel("exp", np.float32([88.3]), np.float32)
    assert ulps(top, np.exp(np.float32([88.3]).astype(np.float64)))[0] <= EXP_MAX_ULPS
    above = np.float32([88.31, 88.8, 100, 1e30, np.inf])
    np.testing.assert_array_equal(kernel("exp", above, np.float32), top[0])
    assert np.isnan(kernel("exp", np.float32([np.nan, -np.nan]), np.float32)).all()


# vexp2's worst case, measured on every float in [-126, 128): 0.95 ulp at -0.497 where a * b + c
# are FMAs, 1.227 ulp at -0.4987 where they are a multiply and an add (x86 without FMA: the
# -mno-avx build of tests/test_cpu_kernel.py).
EXP2_MAX_ULPS = 0.96
EXP2_MAX_ULPS_WITHOUT_FMA = 1.23


def exp2_max_ulps() -> float:
    return EXP2_MAX_ULPS if cpu.library().handle.rankattn_test_fma() else EXP2_MAX_ULPS_WITHOUT_FMA


def test_exp2_is_within_its_ulp_bound_over_its_whole_range():
    """Every 997th float32 bit pattern in [-126, 128) (every exponent, both signs), every float
    in [-0.5, -0.25), where the polynomial's worst case lies, and the ends of the range."""
    x = floats(np.arange(0, 1 << 32, 997, dtype=np.uint64).astype(np.uint32))
    worst_binade = np.arange(0x3E800000, 0x3F000000, dtype=np.uint32) | 0x80000000
    ends = np.float32([-126, np.nextafter(np.float32(-126), 0), 127.99999, 0.5, -0.5])
    x = np.concatenate([x, floats(worst_binade), ends])
    x = x[(x >= np.float32(-126)) & (x < np.float32(128))]
    got = kernel("exp2", x, np.float32)
    err = ulps(got, np.exp2(x.astype(np.float64)))
    assert err.max() <= exp2_max_ulps(), (err.max(), x[err.argmax()])


def test_exp2_is_exact_at_integers_and_zero_below_the_normal_range():
    """2^n exactly (the row's max logit gets p = 1, a power of two times the rest); exact 0
    below -126, so masked -inf logits add nothing to l; NaN stays NaN."""
    n = np.arange(-126, 128, dtype=np.float32)
    np.testing.assert_array_equal(kernel("exp2", n, np.float32), 2.0 ** n.astype(np.float64))
    below = np.float32([np.nextafter(np.float32(-126), -np.inf), -126.5, -127, -150, -1e30,
                        -np.inf])
    np.testing.assert_array_equal(kernel("exp2", below, np.float32), 0.0)
    assert np.isnan(kernel("exp2", np.float32([np.nan, -np.nan]), np.float32)).all()


# vexp2<4>'s worst case (the exp of p that bfloat16 dots take, rounded to 2^-9 relative
# after): 2.69e-6 relative, in float32 Horner with FMA, on the fit's grid of [-1/2, 1/2].
EXP2_DEGREE4_MAX_RELATIVE = 2.8e-6


def test_exp2_of_bfloat16_probabilities_is_within_its_bound_and_zero_below_the_range():
    """The degree-4 exp2 on every 997th float32 in [-126, 128), every float in [-0.5, 0.5]'s
    top binades, where the polynomial's error peaks, and the ends; exact 0 below -126 (masked
    logits), NaN stays NaN. A hundred times under bfloat16's rounding of p."""
    x = floats(np.arange(0, 1 << 32, 997, dtype=np.uint64).astype(np.uint32))
    top = np.arange(0x3E800000, 0x3F000001, dtype=np.uint32)
    ends = np.float32([-126, np.nextafter(np.float32(-126), 0), 127.99999, 0.0])
    x = np.concatenate([x, floats(top), floats(top | 0x80000000), ends])
    x = x[(x >= np.float32(-126)) & (x < np.float32(128))]
    want = np.exp2(x.astype(np.float64))
    relative = np.abs(kernel("exp2_degree4", x, np.float32) / want - 1)
    assert relative.max() <= EXP2_DEGREE4_MAX_RELATIVE, (relative.max(), x[relative.argmax()])
    assert relative.max() < 2.0 ** -9 / 100
    below = np.float32([np.nextafter(np.float32(-126), -np.inf), -150, -np.inf])
    np.testing.assert_array_equal(kernel("exp2_degree4", below, np.float32), 0.0)
    assert np.isnan(kernel("exp2_degree4", np.float32([np.nan]), np.float32)).all()


def test_exp2_stays_finite_and_accurate_where_t_rounds_to_128():
    """Regression: without AVX-512, 2^t for t in [127.5, 128) (n = 128, 2^t < FLT_MAX) was inf:
    2^n came from one float's exponent bits, which cannot hold 2^128. Every float there."""
    x = np.arange(np.float32(127.5), np.float32(128), np.float32(2.0 ** -17), dtype=np.float32)
    assert x.size == 2 ** 16
    want = np.exp2(x.astype(np.float64))
    assert np.isfinite(want).all()
    assert ulps(kernel("exp2", x, np.float32), want).max() <= exp2_max_ulps()
    relative = np.abs(kernel("exp2_degree4", x, np.float32) / want - 1)
    assert relative.max() <= EXP2_DEGREE4_MAX_RELATIVE


def test_the_softmax_range_exp2_gives_the_whole_ranges_bits_up_to_half():
    """The softmax's exp2 (t = s - m' <= 0, up to rounding) scales by 2^n in one step, the
    whole range's in two where AVX-512 is missing: the same bits wherever n <= 0, both
    degrees. Every 997th float32 in [-126, 0.5], the worst binade of each polynomial, the
    underflow below and NaN."""
    x = floats(np.arange(0, 1 << 32, 997, dtype=np.uint64).astype(np.uint32))
    worst = np.arange(0x3E800000, 0x3F000001, dtype=np.uint32)
    x = np.concatenate([x, floats(worst), floats(worst | 0x80000000),
                        np.float32([-126, -126.5, -150, -np.inf, 0.0, -0.0, 0.5, np.nan])])
    x = x[~(x > np.float32(0.5))]
    for whole, softmax in (("exp2", "exp2_softmax"), ("exp2_degree4", "exp2_degree4_softmax")):
        got, want = kernel(softmax, x, np.float32), kernel(whole, x, np.float32)
        assert np.isnan(got[np.isnan(x)]).all()
        np.testing.assert_array_equal(got[~np.isnan(x)].view(np.uint32),
                                      want[~np.isnan(x)].view(np.uint32))


# vtanh's worst case on every 997th float32 and the sets below: 1.33 ulp (at 0.628, just past
# the polynomial's range); 0.75 ulp on |y| < 0.625, where 1 - 2 / (exp(2y) + 1) would lose
# eps / |y| relative.
TANH_MAX_ULPS = 1.35


def test_tanh_is_within_its_ulp_bound_everywhere():
    """The soft cap's tanh, on every 997th float32 bit pattern, every float in [0.5, 1) and
    the small logits of large caps (|y| ~ 1e-3 .. 0.1), where the
    exp form it had carried 8x tanh's error on a cap of 50's logits."""
    x = floats(np.arange(0, 1 << 32, 997, dtype=np.uint64).astype(np.uint32))
    binade = np.arange(0x3F000000, 0x3F800000, dtype=np.uint32)  # both branches meet at 0.625
    x = np.concatenate([x, floats(binade), floats(binade | 0x80000000),
                        np.geomspace(1e-3, 0.1, 10001, dtype=np.float32)])
    x = x[np.isfinite(x)]
    err = ulps(kernel("tanh", x, np.float32), np.tanh(x.astype(np.float64)))
    assert err.max() <= TANH_MAX_ULPS, (err.max(), x[err.argmax()])
    ends = kernel("tanh", np.float32([np.inf, -np.inf, 1e30, np.nan]), np.float32)
    assert ends[:3].tolist() == [1, -1, 1] and np.isnan(ends[3])


def test_kernel_buffers_start_on_cache_lines():
    """Regression: the kernel's buffers came from malloc, 16-byte aligned (a large block starts
    16 bytes into its page), so every 64-byte vector and AMX tile row of them straddled two
    cache lines (the bfloat16 forward ran 18% slower on AMX)."""
    offsets = cpu.library().handle.rankattn_test_buffer_offsets
    offsets.restype = ctypes.c_int64
    for n in (1, 3, 17, 1000, 4099, 1 << 16, 1 << 20):
        assert offsets(ctypes.c_int64(n)) == 0, n


def test_build_reports_its_lanes_and_bfloat16_dots():
    """What the ISA tests of test_cpu_kernel.py check in their builds."""
    handle = cpu.library().handle
    assert handle.rankattn_test_lanes() in (4, 8, 16)
    assert handle.rankattn_test_bf16_dots() in (0, 1, 2)
