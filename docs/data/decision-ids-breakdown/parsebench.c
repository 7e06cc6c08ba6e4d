/*
 * kv_body_parse of 1,024-id completion bodies, outside nginx (docs/BENCHMARKS.md,
 * "Decision time for 1,024 token ids: where the time goes"). 64 bodies shaped like
 * tools/bench_balancer.py's, parsed in turn; the argument is KB of other memory
 * touched between parses (0: none). Build from the repository root after make:
 *   gcc -O2 -Isrc/route -Isrc/core -Isrc/text -Isrc/index -Isrc \
 *       -o /tmp/parsebench docs/data/decision-ids-breakdown/parsebench.c \
 *       build/lib/libkvcore.a -ljansson -lxxhash -lutf8proc -lm -lpthread
 *   taskset -c 0 /tmp/parsebench 0
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "kv_body.h"
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static char bufs[64][8192]; static size_t lens[64];
static char junk[4<<20];
int main(int argc,char**argv){
  int flush = argc>1 ? atoi(argv[1]) : 0; char err[128];
  for(int k=0;k<64;k++){ size_t n=0; char*buf=bufs[k];
    n+=sprintf(buf+n,"{\"model\":\"m\",\"max_tokens\":1,\"prompt\":[");
    for(int i=1;i<=1024;i++) n+=sprintf(buf+n,"%s%d",i>1?",":"",((k+1)*7919+i*31)%30000+100);
    n+=sprintf(buf+n,"]}"); lens[k]=n; }
  int N=20000; double tot=0; unsigned long sink=0;
  for(int i=0;i<N;i++){ int k=i%64;
    if(flush){ for(size_t j=0;j<(size_t)flush*1024;j+=64) junk[j]++; }
    double a=now(); kv_body_t b; if(kv_body_parse(&b,bufs[k],lens[k],err,sizeof err)!=0){puts(err);return 1;} sink+=b.ids[5]; kv_body_free(&b); tot+=now()-a; }
  printf("flush %dKB per parse %.2f us (%lu)\n", flush, tot/N*1e6, sink&1);
}
