#!/bin/sh
# Builds the standalone CPU check (TEAM.md flags). Usage: sh dev/cpu/build.sh [extra cc flags]
set -e
cd "$(dirname "$0")/../.."
cc -std=c11 -O3 -march=native -fno-math-errno -ffp-contract=fast -pthread -Wall -Wextra "$@" \
   -I csrc dev/cpu/check_cpu.c csrc/gdn_common.c csrc/cpu/gdn_cpu_common.c csrc/cpu/gdn_cpu_fwd.c \
   csrc/cpu/gdn_cpu_recurrent.c -lm -o /tmp/check_cpu
