/* prof_fwd.c — single-thread CPU-time of the chunked forward / recurrent
 * (process CPU time, so a busy machine distorts less than wall time).
 * make -C dev prof   (builds dev/build/prof_fwd and runs it) */
#define _POSIX_C_SOURCE 200809L
#include "cpu/gdn_cpu.h"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double cpu_now(void){struct timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID,&t); return t.tv_sec+1e-9*t.tv_nsec;}
static float *fill(int64_t n, float m){float *a=aligned_alloc(64,(size_t)n*4+64); for(int64_t i=0;i<n;i++) a[i]=m*((float)rand()/RAND_MAX-0.5f); return a;}
int main(int argc,char**argv){
    int64_t T = argc>1? atoll(argv[1]) : 2048, HV=4, K=128, V=128;
    fq_gdn_params p; fq_params_init(&p);
    p.B=1;p.T=T;p.N=1;p.H=HV;p.HV=HV;p.K=K;p.V=V;p.scale=0.088;p.num_threads=1;
    p.q=fill(T*HV*K,0.17f);p.k=fill(T*HV*K,0.17f);p.v=fill(T*HV*V,1);
    float *g=fill(T*HV,1),*b=fill(T*HV,1); for(int64_t i=0;i<T*HV;i++){g[i]=-0.5f-g[i];b[i]=0.5f+0.5f*b[i];}
    p.g=g;p.beta=b;p.o=fill(T*HV*V,0);p.h0=fill(HV*K*V,0.1f);p.ht=fill(HV*K*V,0);
    double best=1e9; for(int r=0;r<5;r++){double t0=cpu_now(); fq_cpu_chunk_fwd(&p); double t=cpu_now()-t0; if(t<best)best=t;}
    printf("prefill T=%lld: %.2f ms cpu, %.3f M token-heads/s/thread, %.1f us per chunk-head\n",(long long)T,best*1e3,T*HV/best/1e6,best*1e6/(T/64.0*HV));
    /* decode */
    fq_gdn_params d; fq_params_init(&d); int64_t N=16,H=16,DHV=32;
    d.B=N;d.T=1;d.N=N;d.H=H;d.HV=DHV;d.K=K;d.V=V;d.scale=0.088;d.num_threads=1;
    d.q=fill(N*H*K,0.17f);d.k=fill(N*H*K,0.17f);d.v=fill(N*DHV*V,1);
    float *dg=fill(N*DHV,1),*db=fill(N*DHV,1); for(int64_t i=0;i<N*DHV;i++){dg[i]=-0.5f-dg[i];db[i]=0.5f+0.5f*db[i];}
    d.g=dg;d.beta=db;d.o=fill(N*DHV*V,0);d.state=fill(N*DHV*K*V,0.1f);d.P=N;
    best=1e9; for(int r=0;r<20;r++){double t0=cpu_now(); fq_cpu_recurrent(&d); double t=cpu_now()-t0; if(t<best)best=t;}
    printf("decode: %.3f ms cpu, %.3f M token-heads/s/thread\n",best*1e3,N*DHV/best/1e6);
    return 0;
}
