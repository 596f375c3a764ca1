/* A plain MPI_Allreduce of float32 buffers, with no Horovod and no Python: what the MPI library itself
 * takes across the emulated hosts. benchmarks/mpi_allreduce.py builds it with
 * each MPI's mpicc (MPICH's, Open MPI's) and runs it; it is not part of the package.
 *
 *   mpi_allreduce REPEATS BYTES [BYTES ...]
 *
 * For each size: 2 untimed allreduces (MPI_SUM of rank + 1 in every element), a check that every element
 * is p(p + 1)/2, then REPEATS timed ones, each after MPI_Barrier. Rank 0 prints one line per size,
 *   size BYTES p P times_s T1 T2 ...
 * as soon as it is measured, then "finalize" just before MPI_Finalize and "finalized" after it, so that a
 * run which hangs on the way out still gives its figures and says where it stopped. Exit status 2 on bad
 * arguments, 3 on a wrong sum. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, p;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &p);
    int repeats = argc > 2 ? atoi(argv[1]) : 0;
    if (repeats < 1) {
        if (rank == 0) fprintf(stderr, "usage: %s REPEATS(>=1) BYTES [BYTES ...]\n", argv[0]);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    const float expected = (float)p * (float)(p + 1) / 2.0f;
    for (int a = 2; a < argc; a++) {
        long bytes = atol(argv[a]);
        long n = bytes / (long)sizeof(float);
        if (n < 1) {
            if (rank == 0) fprintf(stderr, "size %s: at least %zu bytes\n", argv[a], sizeof(float));
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
        for (long i = 0; i < n; i++) x[i] = (float)(rank + 1);
        for (int k = 0; k < 2; k++) MPI_Allreduce(x, y, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        for (long i = 0; i < n; i++) {
            if (y[i] != expected) {
                fprintf(stderr, "rank %d, size %ld: element %ld is %g, expected %g\n", rank, bytes, i,
                        (double)y[i], (double)expected);
                MPI_Abort(MPI_COMM_WORLD, 3);
            }
        }
        if (rank == 0) printf("size %ld p %d times_s", n * (long)sizeof(float), p);
        for (int k = 0; k < repeats; k++) {
            MPI_Barrier(MPI_COMM_WORLD);
            double start = MPI_Wtime();
            MPI_Allreduce(x, y, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            if (rank == 0) printf(" %.6f", MPI_Wtime() - start);
        }
        if (rank == 0) {
            printf("\n");
            fflush(stdout);
        }
        free(x);
        free(y);
    }
    if (rank == 0) {
        printf("finalize\n");
        fflush(stdout);
    }
    MPI_Finalize();
    if (rank == 0) {
        printf("finalized\n");
        fflush(stdout);
    }
    return 0;
}
