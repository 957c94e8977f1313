/*
 * x86-64 AVX2 replacements for the hot stages of libjpeg-turbo's plain C
 * decoder: the ISLOW 8x8 inverse DCT (jidctint.c, jpeg_idct_islow), the
 * YCbCr->RGB colour conversion (jdcolor.c/jdcolext.c, ycc_rgb_convert) and
 * the 2:1 "fancy" (triangle) upsampling (jdsample.c, h2v1_fancy_upsample and
 * h2v2_fancy_upsample).
 *
 * The libjpeg-turbo that mozjpeg-sys builds here has no SIMD (that would
 * need NASM), so these stages run its C code.  Each replacement below
 * computes exactly what that C code computes, byte for byte, for every
 * input (valid or not); the comments next to each one say why.  Pillow's
 * libjpeg-turbo, which Kiln must match, uses its own SIMD, which equals the
 * C code on valid data.
 *
 * kiln_jpeg_use_simd is called once the output pass has been set up
 * (right after jpeg_start_decompress).  It swaps in the replacements by
 * rewriting method pointers that libjpeg reads afresh on every call:
 *   - cinfo->idct->inverse_DCT[ci]: the coefficient controller (jdcoefct.c)
 *     reads it each time it decodes an iMCU row, in the single-scan path
 *     (decompress_onepass) and the buffered, multi-scan path
 *     (decompress_data, decompress_smooth_data) alike.  It is set by the
 *     IDCT manager's start_pass, which runs once per output pass; without
 *     buffered-image mode there is exactly one output pass, begun inside
 *     jpeg_start_decompress, so nothing overwrites the pointer afterwards.
 *   - cinfo->cconvert->color_convert: called by the upsampler per row
 *     group.
 *   - the upsampler's per-component method table (my_upsampler in
 *     jdsample.h, the struct jdsample.c allocates).
 * Nothing is replaced when the CPU lacks AVX2, on other architectures or
 * compilers, or when libjpeg-turbo already chose a SIMD routine of its own.
 */

#define JPEG_INTERNALS
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "jpeglib.h" /* with JPEG_INTERNALS, includes jpegint.h */
#include "jpegcomp.h"
#include "jdct.h"
#include "jsimd.h"
#include "jsimddct.h"
#include "jdsample.h"

void kiln_jpeg_use_simd(j_decompress_ptr cinfo);

/* For tests: 0 turns the replacements off (the plain C path is kept). */
void kiln_jpeg_simd_set_enabled(int enabled);

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    BITS_IN_JSAMPLE == 8

#include <immintrin.h>

#define KILN_AVX2 __attribute__((target("avx2")))

/* Fully unrolled loops keep the eight vectors of a block in registers. */
#if defined(__clang__)
#define KILN_UNROLL _Pragma("unroll")
#else
#define KILN_UNROLL _Pragma("GCC unroll 8")
#endif

/* Read and written atomically: a test turns it off while other threads decode. */
static int kiln_simd_enabled = 1;
void kiln_jpeg_simd_set_enabled(int enabled) {
  __atomic_store_n(&kiln_simd_enabled, enabled, __ATOMIC_RELAXED);
}

/*
 * ISLOW inverse DCT.
 *
 * The C code (jidctint.c) does a 1-D IDCT down each column (pass 1, into an
 * int workspace, descaled by CONST_BITS - PASS1_BITS = 11 bits), then along
 * each row (pass 2, descaled by CONST_BITS + PASS1_BITS + 3 = 18 bits), in
 * JLONG (64-bit) arithmetic, then maps each result through the range-limit
 * table.  Here each pass works on eight columns (rows) at once, one per
 * 32-bit lane, with the same constants and the same operations:
 *
 * - Dequantisation is coef (short) * dct_table entry (int), an int product
 *   in C; _mm256_mullo_epi32 gives the same 32 bits.
 * - Pass 1: additions, subtractions, multiplications and left shifts are
 *   exact modulo 2^32 whatever the order, so each pass-1 result equals the
 *   C code's 64-bit one whenever the latter fits in 32 bits.  Every pass-1
 *   result (before the descaling shift, rounding term included) is a linear
 *   combination of the 8 dequantised inputs whose coefficients' absolute
 *   values sum to at most 61214, plus 1024; so with every input in
 *   -32768..32767 it stays below 2^31 and the arithmetic shift gives the C
 *   code's value.  Blocks with a dequantised coefficient outside that range
 *   (only corrupt or pathological files) go to the C function itself.
 * - Pass 2: the output only depends on bits 18..27 of the final sum (C:
 *   range_limit[(int)DESCALE(x, 18) & RANGE_MASK], RANGE_MASK = 1023), and
 *   those bits of a sum of products are exact modulo 2^32, so 32-bit
 *   wrapping arithmetic gives the C code's output for any input.
 * - The multiplications are done by _mm256_madd_epi16 (kiln_idct_1d_16
 *   below) on inputs that fit in 16 bits: always in pass 1 (see above), and
 *   in pass 2 when every pass-1 result does (as on valid data); otherwise
 *   pass 2 uses _mm256_mullo_epi32 (kiln_idct_1d).  Both compute the same
 *   integers, the first with the products regrouped.
 * - The shortcuts of the C code for all-zero AC columns and rows compute
 *   the same value as the full formula (x << 13 descaled by 11 is x << 2;
 *   (w << 13 + 2^17) >> 18 is (w + 16) >> 5), so they need no special case.
 * - The range-limit table (jdmaster.c, prepare_range_limit_table) maps
 *   v = x & 1023 to v + 128 for v < 128, to 255 for 128 <= v < 512, to 0
 *   for 512 <= v < 896 and to v - 896 for v >= 896.  That is
 *   clamp(((v + 512) & 1023) - 384, 0, 255), which the code computes with
 *   the 512 folded into the rounding term (a multiple of 2^18 added before
 *   the shift) and the clamp done by saturating packs.
 */

#define FIX_0_298631336 2446
#define FIX_0_390180644 3196
#define FIX_0_541196100 4433
#define FIX_0_765366865 6270
#define FIX_0_899976223 7373
#define FIX_1_175875602 9633
#define FIX_1_501321110 12299
#define FIX_1_847759065 15137
#define FIX_1_961570560 16069
#define FIX_2_053119869 16819
#define FIX_2_562915447 20995
#define FIX_3_072711026 25172

#define MUL(a, c) _mm256_mullo_epi32((a), _mm256_set1_epi32(c))

/* One 1-D IDCT over eight lanes: in[k] holds input k (k = 0..7) of each
 * lane's column or row; out[k] receives output k before descaling, with
 * `round` added (it is folded into the even part, which every output
 * includes exactly once). */
static inline KILN_AVX2 void kiln_idct_1d(const __m256i in[8], __m256i out[8],
                                          __m256i round) {
  __m256i z1, z2, z3, z4, z5, tmp0, tmp1, tmp2, tmp3;
  __m256i tmp10, tmp11, tmp12, tmp13;

  /* Even part. */
  z2 = in[2];
  z3 = in[6];
  z1 = MUL(_mm256_add_epi32(z2, z3), FIX_0_541196100);
  tmp2 = _mm256_add_epi32(z1, MUL(z3, -FIX_1_847759065));
  tmp3 = _mm256_add_epi32(z1, MUL(z2, FIX_0_765366865));

  tmp0 = _mm256_add_epi32(
      _mm256_slli_epi32(_mm256_add_epi32(in[0], in[4]), 13), round);
  tmp1 = _mm256_add_epi32(
      _mm256_slli_epi32(_mm256_sub_epi32(in[0], in[4]), 13), round);

  tmp10 = _mm256_add_epi32(tmp0, tmp3);
  tmp13 = _mm256_sub_epi32(tmp0, tmp3);
  tmp11 = _mm256_add_epi32(tmp1, tmp2);
  tmp12 = _mm256_sub_epi32(tmp1, tmp2);

  /* Odd part. */
  tmp0 = in[7];
  tmp1 = in[5];
  tmp2 = in[3];
  tmp3 = in[1];

  z1 = _mm256_add_epi32(tmp0, tmp3);
  z2 = _mm256_add_epi32(tmp1, tmp2);
  z3 = _mm256_add_epi32(tmp0, tmp2);
  z4 = _mm256_add_epi32(tmp1, tmp3);
  z5 = MUL(_mm256_add_epi32(z3, z4), FIX_1_175875602);

  tmp0 = MUL(tmp0, FIX_0_298631336);
  tmp1 = MUL(tmp1, FIX_2_053119869);
  tmp2 = MUL(tmp2, FIX_3_072711026);
  tmp3 = MUL(tmp3, FIX_1_501321110);
  z1 = MUL(z1, -FIX_0_899976223);
  z2 = MUL(z2, -FIX_2_562915447);
  z3 = MUL(z3, -FIX_1_961570560);
  z4 = MUL(z4, -FIX_0_390180644);

  z3 = _mm256_add_epi32(z3, z5);
  z4 = _mm256_add_epi32(z4, z5);

  tmp0 = _mm256_add_epi32(tmp0, _mm256_add_epi32(z1, z3));
  tmp1 = _mm256_add_epi32(tmp1, _mm256_add_epi32(z2, z4));
  tmp2 = _mm256_add_epi32(tmp2, _mm256_add_epi32(z2, z3));
  tmp3 = _mm256_add_epi32(tmp3, _mm256_add_epi32(z1, z4));

  out[0] = _mm256_add_epi32(tmp10, tmp3);
  out[7] = _mm256_sub_epi32(tmp10, tmp3);
  out[1] = _mm256_add_epi32(tmp11, tmp2);
  out[6] = _mm256_sub_epi32(tmp11, tmp2);
  out[2] = _mm256_add_epi32(tmp12, tmp1);
  out[5] = _mm256_sub_epi32(tmp12, tmp1);
  out[3] = _mm256_add_epi32(tmp13, tmp0);
  out[4] = _mm256_sub_epi32(tmp13, tmp0);
}

/* The same 1-D IDCT for inputs that fit in 16 bits, with
 * _mm256_madd_epi16 (a * c + b * d of 16-bit pairs, exact in 32 bits)
 * doing the multiplications.  Expanding the products of the code above
 * (z1 = FIX_0_541196100 * (in2 + in6) and so on) gives, for the even part,
 *   tmp2 = 4433 * in2 - 10704 * in6,   tmp3 = 10703 * in2 + 4433 * in6,
 * and for the odd part, with t0..t3 = in7, in5, in3, in1:
 *   tmp0 = -11363 t0 + 9633 t1 - 6436 t2 + 2260 t3
 *   tmp1 =   9633 t0 + 2261 t1 - 11362 t2 + 6437 t3
 *   tmp2 =  -6436 t0 - 11362 t1 - 2259 t2 + 9633 t3
 *   tmp3 =   2260 t0 + 6437 t1 + 9633 t2 + 11363 t3
 * These are the same integers (identities of integer arithmetic, so the
 * results agree modulo 2^32 like those of the code above). */

/* A 32-bit lane holding the 16-bit pair (a, b), a in the low half. */
#define PAIR(a, b)                                      \
  _mm256_set1_epi32((int)(((unsigned int)(a) & 0xFFFF) | \
                          ((unsigned int)(b) << 16)))

/* Lanes of x and y interleaved as 16-bit pairs (low 16 bits of each). */
static inline KILN_AVX2 __m256i kiln_pairs(__m256i x, __m256i y) {
  return _mm256_blend_epi16(x, _mm256_slli_epi32(y, 16), 0xAA);
}

static inline KILN_AVX2 void kiln_idct_1d_16(const __m256i in[8],
                                             __m256i out[8], __m256i round) {
  __m256i p26 = kiln_pairs(in[2], in[6]);
  __m256i p75 = kiln_pairs(in[7], in[5]);
  __m256i p31 = kiln_pairs(in[3], in[1]);
  __m256i tmp0, tmp1, tmp2, tmp3, tmp10, tmp11, tmp12, tmp13;

  /* Even part. */
  tmp2 = _mm256_madd_epi16(p26, PAIR(4433, -10704));
  tmp3 = _mm256_madd_epi16(p26, PAIR(10703, 4433));
  tmp0 = _mm256_add_epi32(
      _mm256_slli_epi32(_mm256_add_epi32(in[0], in[4]), 13), round);
  tmp1 = _mm256_add_epi32(
      _mm256_slli_epi32(_mm256_sub_epi32(in[0], in[4]), 13), round);
  tmp10 = _mm256_add_epi32(tmp0, tmp3);
  tmp13 = _mm256_sub_epi32(tmp0, tmp3);
  tmp11 = _mm256_add_epi32(tmp1, tmp2);
  tmp12 = _mm256_sub_epi32(tmp1, tmp2);

  /* Odd part. */
  tmp0 = _mm256_add_epi32(_mm256_madd_epi16(p75, PAIR(-11363, 9633)),
                          _mm256_madd_epi16(p31, PAIR(-6436, 2260)));
  tmp1 = _mm256_add_epi32(_mm256_madd_epi16(p75, PAIR(9633, 2261)),
                          _mm256_madd_epi16(p31, PAIR(-11362, 6437)));
  tmp2 = _mm256_add_epi32(_mm256_madd_epi16(p75, PAIR(-6436, -11362)),
                          _mm256_madd_epi16(p31, PAIR(-2259, 9633)));
  tmp3 = _mm256_add_epi32(_mm256_madd_epi16(p75, PAIR(2260, 6437)),
                          _mm256_madd_epi16(p31, PAIR(9633, 11363)));

  out[0] = _mm256_add_epi32(tmp10, tmp3);
  out[7] = _mm256_sub_epi32(tmp10, tmp3);
  out[1] = _mm256_add_epi32(tmp11, tmp2);
  out[6] = _mm256_sub_epi32(tmp11, tmp2);
  out[2] = _mm256_add_epi32(tmp12, tmp1);
  out[5] = _mm256_sub_epi32(tmp12, tmp1);
  out[3] = _mm256_add_epi32(tmp13, tmp0);
  out[4] = _mm256_sub_epi32(tmp13, tmp0);
}

/* Nonzero lanes where some lane of x is outside -32768..32767. */
static inline KILN_AVX2 __m256i kiln_out_of_16(__m256i x) {
  return _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(32768)), 16);
}

/* Transposes an 8x8 matrix of 32-bit values held as eight rows. */
static inline KILN_AVX2 void kiln_transpose8(__m256i m[8]) {
  __m256i t0 = _mm256_unpacklo_epi32(m[0], m[1]);
  __m256i t1 = _mm256_unpackhi_epi32(m[0], m[1]);
  __m256i t2 = _mm256_unpacklo_epi32(m[2], m[3]);
  __m256i t3 = _mm256_unpackhi_epi32(m[2], m[3]);
  __m256i t4 = _mm256_unpacklo_epi32(m[4], m[5]);
  __m256i t5 = _mm256_unpackhi_epi32(m[4], m[5]);
  __m256i t6 = _mm256_unpacklo_epi32(m[6], m[7]);
  __m256i t7 = _mm256_unpackhi_epi32(m[6], m[7]);
  __m256i u0 = _mm256_unpacklo_epi64(t0, t2);
  __m256i u1 = _mm256_unpackhi_epi64(t0, t2);
  __m256i u2 = _mm256_unpacklo_epi64(t1, t3);
  __m256i u3 = _mm256_unpackhi_epi64(t1, t3);
  __m256i u4 = _mm256_unpacklo_epi64(t4, t6);
  __m256i u5 = _mm256_unpackhi_epi64(t4, t6);
  __m256i u6 = _mm256_unpacklo_epi64(t5, t7);
  __m256i u7 = _mm256_unpackhi_epi64(t5, t7);
  m[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
  m[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
  m[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
  m[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
  m[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
  m[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
  m[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
  m[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

/* The range-limit mapping described above, for one value in plain C. */
static JSAMPLE kiln_range_limit(unsigned int bits) {
  int u = (int)((bits + 512) & 1023) - 384;
  return (JSAMPLE)(u < 0 ? 0 : (u > 255 ? 255 : u));
}

static KILN_AVX2 void kiln_idct_islow_avx2(j_decompress_ptr cinfo,
                                           jpeg_component_info *compptr,
                                           JCOEFPTR coef_block,
                                           JSAMPARRAY output_buf,
                                           JDIMENSION output_col) {
  const ISLOW_MULT_TYPE *quant = (const ISLOW_MULT_TYPE *)compptr->dct_table;
  __m256i v[8], w[8];
  __m256i c0 = _mm256_loadu_si256((const __m256i *)(coef_block + 0));
  __m256i c1 = _mm256_loadu_si256((const __m256i *)(coef_block + 16));
  __m256i c2 = _mm256_loadu_si256((const __m256i *)(coef_block + 32));
  __m256i c3 = _mm256_loadu_si256((const __m256i *)(coef_block + 48));
  __m256i ac = _mm256_or_si256(_mm256_or_si256(c1, c2), c3);
  __m256i range = _mm256_setzero_si256();
  int k;

  /* Every AC coefficient zero: every output is the DC term, computed as
   * the C code's shortcuts do (in int, wrapping like it). */
  ac = _mm256_or_si256(
      ac, _mm256_and_si256(c0, _mm256_setr_epi16(0, -1, -1, -1, -1, -1, -1, -1,
                                                 -1, -1, -1, -1, -1, -1, -1,
                                                 -1)));
  if (_mm256_testz_si256(ac, ac)) {
    unsigned int dc = (unsigned int)(ISLOW_MULT_TYPE)coef_block[0] *
                      (unsigned int)quant[0];
    JSAMPLE value = kiln_range_limit((((dc << 2) + 16) >> 5) & 1023);
    for (k = 0; k < DCTSIZE; k++) memset(output_buf[k] + output_col, value, 8);
    return;
  }

  /* Dequantise; v[k] holds row k of the block, one column per lane. */
  KILN_UNROLL
  for (k = 0; k < DCTSIZE; k++) {
    __m256i coef = _mm256_cvtepi16_epi32(
        _mm_loadu_si128((const __m128i *)(coef_block + k * DCTSIZE)));
    __m256i q;
    if (sizeof(ISLOW_MULT_TYPE) == 4) {
      q = _mm256_loadu_si256((const __m256i *)(quant + k * DCTSIZE));
    } else {
      q = _mm256_cvtepi16_epi32(
          _mm_loadu_si128((const __m128i *)(quant + k * DCTSIZE)));
    }
    v[k] = _mm256_mullo_epi32(coef, q);
    /* (v + 32768) >> 16, unsigned, is 0 exactly when -32768 <= v <= 32767. */
    range = _mm256_or_si256(range, kiln_out_of_16(v[k]));
  }
  if (!_mm256_testz_si256(range, range)) {
    jpeg_idct_islow(cinfo, compptr, coef_block, output_buf, output_col);
    return;
  }

  /* Pass 1: columns.  Descale by 11 bits, rounding. */
  kiln_idct_1d_16(v, w, _mm256_set1_epi32(1 << 10));
  KILN_UNROLL
  for (k = 0; k < DCTSIZE; k++) {
    w[k] = _mm256_srai_epi32(w[k], 11);
    range = _mm256_or_si256(range, kiln_out_of_16(w[k]));
  }

  /* w[k] is row k of the workspace; pass 2 needs its columns. */
  kiln_transpose8(w);

  /* Pass 2: rows (one per lane).  Rounding 2^17, plus 512 << 18 for the
   * range limit; keep bits 18..27 and subtract 384. */
  if (_mm256_testz_si256(range, range))
    kiln_idct_1d_16(w, v, _mm256_set1_epi32((1 << 17) + (512 << 18)));
  else
    kiln_idct_1d(w, v, _mm256_set1_epi32((1 << 17) + (512 << 18)));
  KILN_UNROLL
  for (k = 0; k < DCTSIZE; k++) {
    v[k] = _mm256_sub_epi32(
        _mm256_and_si256(_mm256_srli_epi32(v[k], 18), _mm256_set1_epi32(1023)),
        _mm256_set1_epi32(384));
  }

  /* v[k] holds output column k, one row per lane: back to rows, clamp to
   * 0..255 with saturating packs and store. */
  kiln_transpose8(v);
  {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i r0123 = _mm256_packus_epi16(_mm256_packs_epi32(v[0], v[1]),
                                        _mm256_packs_epi32(v[2], v[3]));
    __m256i r4567 = _mm256_packus_epi16(_mm256_packs_epi32(v[4], v[5]),
                                        _mm256_packs_epi32(v[6], v[7]));
    /* Each 128-bit lane now holds the first (second) halves of 4 rows. */
    r0123 = _mm256_permutevar8x32_epi32(r0123, order);
    r4567 = _mm256_permutevar8x32_epi32(r4567, order);
    {
      __m128i lo = _mm256_castsi256_si128(r0123);
      __m128i hi = _mm256_extracti128_si256(r0123, 1);
      _mm_storel_epi64((__m128i *)(output_buf[0] + output_col), lo);
      _mm_storel_epi64((__m128i *)(output_buf[1] + output_col),
                       _mm_unpackhi_epi64(lo, lo));
      _mm_storel_epi64((__m128i *)(output_buf[2] + output_col), hi);
      _mm_storel_epi64((__m128i *)(output_buf[3] + output_col),
                       _mm_unpackhi_epi64(hi, hi));
      lo = _mm256_castsi256_si128(r4567);
      hi = _mm256_extracti128_si256(r4567, 1);
      _mm_storel_epi64((__m128i *)(output_buf[4] + output_col), lo);
      _mm_storel_epi64((__m128i *)(output_buf[5] + output_col),
                       _mm_unpackhi_epi64(lo, lo));
      _mm_storel_epi64((__m128i *)(output_buf[6] + output_col), hi);
      _mm_storel_epi64((__m128i *)(output_buf[7] + output_col),
                       _mm_unpackhi_epi64(hi, hi));
    }
  }
}

/*
 * YCbCr -> RGB.
 *
 * The C code (jdcolor.c, build_ycc_rgb_table; jdcolext.c) computes, with
 * SCALEBITS = 16, ONE_HALF = 1 << 15 and x = cb - 128, z = cr - 128:
 *   R = range_limit[y + ((FIX(1.40200) * z + ONE_HALF) >> 16)]
 *   G = range_limit[y + ((-FIX(0.34414) * x + ONE_HALF - FIX(0.71414) * z)
 *                        >> 16)]
 *   B = range_limit[y + ((FIX(1.77200) * x + ONE_HALF) >> 16)]
 * with FIX(1.40200) = 91881, FIX(0.34414) = 22554, FIX(0.71414) = 46802,
 * FIX(1.77200) = 116130, and range_limit clamping to 0..255 (its index is
 * within -256..511 here).  All of it fits easily in 32 bits, so the same
 * formulas in 32-bit lanes, clamped by saturating packs, give the same
 * bytes.
 */

#define KILN_CR_R 91881
#define KILN_CB_G 22554
#define KILN_CR_G 46802
#define KILN_CB_B 116130

/* The multiplications use _mm256_madd_epi16 on 16-bit pairs, which needs
 * constants below 2^15; splitting off multiples of 65536 (exact, as they
 * pass through the shift unchanged) gives, for x and z in -128..127,
 *   (91881 * z + 32768) >> 16 = z + ((26345 * z + 2 * 16384) >> 16)
 *   (-22554 * x - 46802 * z + 32768) >> 16
 *       = -z + ((-22554 * x + 18734 * z + 32768) >> 16)
 *   (116130 * x + 32768) >> 16 = 2 * x + ((-14942 * x + 2 * 16384) >> 16)
 * The unpacks pair up the 16-bit lanes within each 128-bit half, and the
 * saturating packs (of values far inside the 16-bit range) undo that
 * order. */
static inline KILN_AVX2 __m256i kiln_shift16(__m256i lo, __m256i hi) {
  return _mm256_packs_epi32(_mm256_srai_epi32(lo, 16),
                            _mm256_srai_epi32(hi, 16));
}

/* Converts 16 pixels to R, G and B (16-bit lanes, not yet clamped). */
static inline KILN_AVX2 void kiln_ycc_16(__m128i y8, __m128i cb8, __m128i cr8,
                                         __m256i *r, __m256i *g, __m256i *b) {
  const __m256i center = _mm256_set1_epi16(128);
  const __m256i two = _mm256_set1_epi16(2);
  const __m256i half = _mm256_set1_epi32(1 << 15);
  __m256i y = _mm256_cvtepu8_epi16(y8);
  __m256i x = _mm256_sub_epi16(_mm256_cvtepu8_epi16(cb8), center);
  __m256i z = _mm256_sub_epi16(_mm256_cvtepu8_epi16(cr8), center);
  __m256i z2lo = _mm256_unpacklo_epi16(z, two);
  __m256i z2hi = _mm256_unpackhi_epi16(z, two);
  __m256i xzlo = _mm256_unpacklo_epi16(x, z);
  __m256i xzhi = _mm256_unpackhi_epi16(x, z);
  __m256i x2lo = _mm256_unpacklo_epi16(x, two);
  __m256i x2hi = _mm256_unpackhi_epi16(x, two);
  *r = _mm256_add_epi16(
      _mm256_add_epi16(y, z),
      kiln_shift16(_mm256_madd_epi16(z2lo, PAIR(26345, 16384)),
                   _mm256_madd_epi16(z2hi, PAIR(26345, 16384))));
  *g = _mm256_add_epi16(
      _mm256_sub_epi16(y, z),
      kiln_shift16(
          _mm256_add_epi32(_mm256_madd_epi16(xzlo, PAIR(-22554, 18734)), half),
          _mm256_add_epi32(_mm256_madd_epi16(xzhi, PAIR(-22554, 18734)),
                           half)));
  *b = _mm256_add_epi16(
      _mm256_add_epi16(y, _mm256_add_epi16(x, x)),
      kiln_shift16(_mm256_madd_epi16(x2lo, PAIR(-14942, 16384)),
                   _mm256_madd_epi16(x2hi, PAIR(-14942, 16384))));
}

static int kiln_clamp255(int v) { return v < 0 ? 0 : (v > 255 ? 255 : v); }

static KILN_AVX2 void kiln_ycc_rgb_avx2(j_decompress_ptr cinfo,
                                        JSAMPIMAGE input_buf,
                                        JDIMENSION input_row,
                                        JSAMPARRAY output_buf, int num_rows) {
  JDIMENSION num_cols = cinfo->output_width;
  const __m128i r0 = _mm_setr_epi8(0, -128, -128, 1, -128, -128, 2, -128,
                                   -128, 3, -128, -128, 4, -128, -128, 5);
  const __m128i r1 = _mm_setr_epi8(-128, -128, 6, -128, -128, 7, -128, -128,
                                   8, -128, -128, 9, -128, -128, 10, -128);
  const __m128i r2 = _mm_setr_epi8(-128, 11, -128, -128, 12, -128, -128, 13,
                                   -128, -128, 14, -128, -128, 15, -128, -128);
  const __m128i g0 = _mm_setr_epi8(-128, 0, -128, -128, 1, -128, -128, 2,
                                   -128, -128, 3, -128, -128, 4, -128, -128);
  const __m128i g1 = _mm_setr_epi8(5, -128, -128, 6, -128, -128, 7, -128,
                                   -128, 8, -128, -128, 9, -128, -128, 10);
  const __m128i g2 = _mm_setr_epi8(-128, -128, 11, -128, -128, 12, -128, -128,
                                   13, -128, -128, 14, -128, -128, 15, -128);
  const __m128i b0 = _mm_setr_epi8(-128, -128, 0, -128, -128, 1, -128, -128,
                                   2, -128, -128, 3, -128, -128, 4, -128);
  const __m128i b1 = _mm_setr_epi8(-128, 5, -128, -128, 6, -128, -128, 7,
                                   -128, -128, 8, -128, -128, 9, -128, -128);
  const __m128i b2 = _mm_setr_epi8(10, -128, -128, 11, -128, -128, 12, -128,
                                   -128, 13, -128, -128, 14, -128, -128, 15);

  while (--num_rows >= 0) {
    const JSAMPLE *in0 = input_buf[0][input_row];
    const JSAMPLE *in1 = input_buf[1][input_row];
    const JSAMPLE *in2 = input_buf[2][input_row];
    JSAMPROW out = *output_buf++;
    JDIMENSION col = 0;
    input_row++;
    for (; col + 16 <= num_cols; col += 16) {
      __m128i y8 = _mm_loadu_si128((const __m128i *)(in0 + col));
      __m128i cb8 = _mm_loadu_si128((const __m128i *)(in1 + col));
      __m128i cr8 = _mm_loadu_si128((const __m128i *)(in2 + col));
      __m256i r16, g16, b16, rg, bb;
      __m128i r, g, b;
      kiln_ycc_16(y8, cb8, cr8, &r16, &g16, &b16);
      /* Saturate to 0..255: lane 0 = R0..7 G0..7, lane 1 = R8..15 G8..15. */
      rg = _mm256_permute4x64_epi64(_mm256_packus_epi16(r16, g16), 0xD8);
      bb = _mm256_permute4x64_epi64(_mm256_packus_epi16(b16, b16), 0xD8);
      r = _mm256_castsi256_si128(rg);
      g = _mm256_extracti128_si256(rg, 1);
      b = _mm256_castsi256_si128(bb);
      _mm_storeu_si128((__m128i *)(out + 0),
                       _mm_or_si128(_mm_or_si128(_mm_shuffle_epi8(r, r0),
                                                 _mm_shuffle_epi8(g, g0)),
                                    _mm_shuffle_epi8(b, b0)));
      _mm_storeu_si128((__m128i *)(out + 16),
                       _mm_or_si128(_mm_or_si128(_mm_shuffle_epi8(r, r1),
                                                 _mm_shuffle_epi8(g, g1)),
                                    _mm_shuffle_epi8(b, b1)));
      _mm_storeu_si128((__m128i *)(out + 32),
                       _mm_or_si128(_mm_or_si128(_mm_shuffle_epi8(r, r2),
                                                 _mm_shuffle_epi8(g, g2)),
                                    _mm_shuffle_epi8(b, b2)));
      out += 48;
    }
    for (; col < num_cols; col++) {
      int y = in0[col], x = in1[col] - 128, z = in2[col] - 128;
      out[0] = (JSAMPLE)kiln_clamp255(y + ((KILN_CR_R * z + (1 << 15)) >> 16));
      out[1] = (JSAMPLE)kiln_clamp255(
          y + (((1 << 15) - KILN_CB_G * x - KILN_CR_G * z) >> 16));
      out[2] = (JSAMPLE)kiln_clamp255(y + ((KILN_CB_B * x + (1 << 15)) >> 16));
      out += 3;
    }
  }
}

/*
 * Fancy upsampling, 2:1 horizontally (h2v1) and 2:1 both ways (h2v2).
 *
 * jdsample.c computes, for input samples s[0..n-1] of a row (h2v1):
 *   out[2i]     = (3 * s[i] + s[i-1] + 1) >> 2
 *   out[2i + 1] = (3 * s[i] + s[i+1] + 2) >> 2
 * and for h2v2, with column sums c[i] = 3 * s[i] + t[i] (t the row above for
 * the upper output row, the row below for the lower one):
 *   out[2i]     = (3 * c[i] + c[i-1] + 8) >> 4
 *   out[2i + 1] = (3 * c[i] + c[i+1] + 7) >> 4
 * Its special first and last columns are these formulas with s[-1] = s[0]
 * and s[n] = s[n-1] (c likewise): (4 s + 1) >> 2 = s, (4 c + 8) >> 4, ...
 * Every value fits in 16 bits (at most 4 * 1020 + 8), so 16-bit lanes give
 * the same results; the first and last columns, and the columns left over
 * at the end of a row, are done by the same formulas in plain C.  The two
 * outputs of each input sample are stored as one 16-bit word (even output
 * in the low byte), which is their order in memory.
 */

static KILN_AVX2 void kiln_h2v1_row(const JSAMPLE *in, JSAMPLE *out,
                                    JDIMENSION n) {
  JDIMENSION i = 1;
  const __m256i three = _mm256_set1_epi16(3);
  out[0] = in[0];
  out[1] = (JSAMPLE)((in[0] * 3 + in[1] + 2) >> 2);
  /* Reads in[i - 1 .. i + 16], all within the row while i + 17 <= n. */
  for (; i + 17 <= n; i += 16) {
    __m256i s = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(in + i)));
    __m256i prev =
        _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(in + i - 1)));
    __m256i next =
        _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(in + i + 1)));
    __m256i s3 = _mm256_mullo_epi16(s, three);
    __m256i even = _mm256_srli_epi16(
        _mm256_add_epi16(_mm256_add_epi16(s3, prev), _mm256_set1_epi16(1)), 2);
    __m256i odd = _mm256_srli_epi16(
        _mm256_add_epi16(_mm256_add_epi16(s3, next), _mm256_set1_epi16(2)), 2);
    _mm256_storeu_si256((__m256i *)(out + 2 * i),
                        _mm256_or_si256(even, _mm256_slli_epi16(odd, 8)));
  }
  for (; i + 1 < n; i++) {
    int s3 = in[i] * 3;
    out[2 * i] = (JSAMPLE)((s3 + in[i - 1] + 1) >> 2);
    out[2 * i + 1] = (JSAMPLE)((s3 + in[i + 1] + 2) >> 2);
  }
  out[2 * (n - 1)] = (JSAMPLE)((in[n - 1] * 3 + in[n - 2] + 1) >> 2);
  out[2 * (n - 1) + 1] = in[n - 1];
}

static KILN_AVX2 void kiln_h2v1_fancy_avx2(j_decompress_ptr cinfo,
                                           jpeg_component_info *compptr,
                                           JSAMPARRAY input_data,
                                           JSAMPARRAY *output_data_ptr) {
  JSAMPARRAY output_data = *output_data_ptr;
  int inrow;
  for (inrow = 0; inrow < cinfo->max_v_samp_factor; inrow++) {
    kiln_h2v1_row(input_data[inrow], output_data[inrow],
                  compptr->downsampled_width);
  }
}

static inline KILN_AVX2 __m256i kiln_colsum(const JSAMPLE *near,
                                            const JSAMPLE *far) {
  __m256i a = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)near));
  __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)far));
  return _mm256_add_epi16(_mm256_mullo_epi16(a, _mm256_set1_epi16(3)), b);
}

static KILN_AVX2 void kiln_h2v2_row(const JSAMPLE *in0, const JSAMPLE *in1,
                                    JSAMPLE *out, JDIMENSION n) {
  JDIMENSION i = 1;
  int c0 = in0[0] * 3 + in1[0], c1 = in0[1] * 3 + in1[1];
  out[0] = (JSAMPLE)((c0 * 4 + 8) >> 4);
  out[1] = (JSAMPLE)((c0 * 3 + c1 + 7) >> 4);
  for (; i + 17 <= n; i += 16) {
    __m256i c = kiln_colsum(in0 + i, in1 + i);
    __m256i prev = kiln_colsum(in0 + i - 1, in1 + i - 1);
    __m256i next = kiln_colsum(in0 + i + 1, in1 + i + 1);
    __m256i c3 = _mm256_mullo_epi16(c, _mm256_set1_epi16(3));
    __m256i even = _mm256_srli_epi16(
        _mm256_add_epi16(_mm256_add_epi16(c3, prev), _mm256_set1_epi16(8)), 4);
    __m256i odd = _mm256_srli_epi16(
        _mm256_add_epi16(_mm256_add_epi16(c3, next), _mm256_set1_epi16(7)), 4);
    _mm256_storeu_si256((__m256i *)(out + 2 * i),
                        _mm256_or_si256(even, _mm256_slli_epi16(odd, 8)));
  }
  for (; i + 1 < n; i++) {
    int c = in0[i] * 3 + in1[i];
    int prev = in0[i - 1] * 3 + in1[i - 1];
    int next = in0[i + 1] * 3 + in1[i + 1];
    out[2 * i] = (JSAMPLE)((c * 3 + prev + 8) >> 4);
    out[2 * i + 1] = (JSAMPLE)((c * 3 + next + 7) >> 4);
  }
  {
    int c = in0[n - 1] * 3 + in1[n - 1];
    int prev = in0[n - 2] * 3 + in1[n - 2];
    out[2 * (n - 1)] = (JSAMPLE)((c * 3 + prev + 8) >> 4);
    out[2 * (n - 1) + 1] = (JSAMPLE)((c * 4 + 7) >> 4);
  }
}

static KILN_AVX2 void kiln_h2v2_fancy_avx2(j_decompress_ptr cinfo,
                                           jpeg_component_info *compptr,
                                           JSAMPARRAY input_data,
                                           JSAMPARRAY *output_data_ptr) {
  JSAMPARRAY output_data = *output_data_ptr;
  int inrow = 0, outrow = 0;
  while (outrow < cinfo->max_v_samp_factor) {
    /* Upper output row: the next nearest input row is the one above;
     * lower output row: the one below (context rows, as in jdsample.c). */
    kiln_h2v2_row(input_data[inrow], input_data[inrow - 1],
                  output_data[outrow++], compptr->downsampled_width);
    kiln_h2v2_row(input_data[inrow], input_data[inrow + 1],
                  output_data[outrow++], compptr->downsampled_width);
    inrow++;
  }
}

void kiln_jpeg_use_simd(j_decompress_ptr cinfo) {
  int ci;
  jpeg_component_info *compptr;

  if (!__atomic_load_n(&kiln_simd_enabled, __ATOMIC_RELAXED) ||
      !__builtin_cpu_supports("avx2"))
    return;

  /* IDCT: only where jddctmgr.c chose the plain C ISLOW routine, which it
   * does for 8x8 output blocks with dct_method JDCT_ISLOW. */
  for (ci = 0, compptr = cinfo->comp_info; ci < cinfo->num_components;
       ci++, compptr++) {
    if (compptr->_DCT_scaled_size == DCTSIZE &&
        cinfo->idct->inverse_DCT[ci] == jpeg_idct_islow)
      cinfo->idct->inverse_DCT[ci] = kiln_idct_islow_avx2;
  }

  if (cinfo->raw_data_out) return;

  /* Colour conversion: jdcolor.c picks ycc_rgb_convert for YCbCr -> RGB
   * when libjpeg-turbo has no SIMD version (and the merged upsampler, which
   * would bypass the colour converter, is never used with fancy
   * upsampling). */
  if (cinfo->do_fancy_upsampling && !cinfo->quantize_colors &&
      cinfo->jpeg_color_space == JCS_YCbCr && cinfo->num_components == 3 &&
      cinfo->out_color_space == JCS_RGB && cinfo->out_color_components == 3 &&
      !jsimd_can_ycc_rgb())
    cinfo->cconvert->color_convert = kiln_ycc_rgb_avx2;

  /* Upsampling: the same choice as jinit_upsampler (jdsample.c) makes for
   * its h2v1_fancy_upsample and h2v2_fancy_upsample.  With fancy
   * upsampling, cinfo->upsample is always jdsample.c's my_upsampler. */
  if (cinfo->do_fancy_upsampling && cinfo->_min_DCT_scaled_size > 1) {
    my_upsample_ptr upsample = (my_upsample_ptr)cinfo->upsample;
    for (ci = 0, compptr = cinfo->comp_info; ci < cinfo->num_components;
         ci++, compptr++) {
      int h_in = (compptr->h_samp_factor * compptr->_DCT_scaled_size) /
                 cinfo->_min_DCT_scaled_size;
      int v_in = (compptr->v_samp_factor * compptr->_DCT_scaled_size) /
                 cinfo->_min_DCT_scaled_size;
      int h_out = cinfo->max_h_samp_factor;
      int v_out = cinfo->max_v_samp_factor;
      if (!compptr->component_needed || compptr->downsampled_width <= 2)
        continue;
      if (h_in * 2 == h_out && v_in == v_out &&
          !jsimd_can_h2v1_fancy_upsample())
        upsample->methods[ci] = kiln_h2v1_fancy_avx2;
      else if (h_in * 2 == h_out && v_in * 2 == v_out &&
               !jsimd_can_h2v2_fancy_upsample())
        upsample->methods[ci] = kiln_h2v2_fancy_avx2;
    }
  }
}

#else

void kiln_jpeg_use_simd(j_decompress_ptr cinfo) { (void)cinfo; }
void kiln_jpeg_simd_set_enabled(int enabled) { (void)enabled; }

#endif
