"""The benchmarks: scripts that share ``benchmarks.harness`` and write rows through
``benchmarks.rows``; ``bash benchmarks/run.sh SUITE OUT`` runs them by what they measure."""
