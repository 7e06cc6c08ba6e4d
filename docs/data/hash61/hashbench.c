#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "kv_hash.h"
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e9+t.tv_nsec;}
int main(void){
  static uint32_t tok[8192]; static uint64_t seq[8192/16]; uint64_t x=0;
  for(int i=0;i<8192;i++) tok[i]=(i*2654435761u)%150000;
  double best=1e18, bestc=1e18;
  for(int r=0;r<9;r++){double t0=now(); for(int k=0;k<2000;k++){kv_hash_blocks(tok,1024,16,KV_HASH_SEED,NULL,seq); x^=seq[63];} double d=(now()-t0)/2000; if(d<best)best=d;
    t0=now(); for(int k=0;k<2000000;k++){x=kv_hash_chain(x,k);} d=(now()-t0)/2000000; if(d<bestc)bestc=d;}
  printf("1024 ids: %.0f ns  chain: %.1f ns  (%llx)\n",best,bestc,(unsigned long long)x);
}
