// Include first, before any ATen header, in a CPU kernel that uses at::vec::Vectorized.
//
// ATen's Vectorized has its AVX2/AVX512 specialisations only inside ATen's per-ISA builds: in an
// extension TU it is the scalar fallback, whose array round trips through the stack stall on store
// forwarding (zch.cpp's pooling spent most of its time there). The extension is built for
// x86-64-v3, so let at::vec use its AVX2 implementation, in a namespace of our own so its inline
// functions never collide with libtorch's per-capability copies. Every TU that includes
// cpu_rows.h must include this too: its inline row primitives must be the same code in each TU.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(CPU_CAPABILITY)
#define CPU_CAPABILITY gk_avx2
#define CPU_CAPABILITY_AVX2
#endif
