/*
 * evict_driver [BLOCKS [MB [REMOVE [SLIDE [WINDOW [WORKERS]]]]]]: eviction-heavy ingest
 * into a small index (default 5M blocks into 16 MB, 64 workers, 256-block documents
 * over a sliding window); prints one JSON line (held blocks, evictions, holes, lost
 * slots). From a helper of stop 60 (docs/BENCHMARKS.md, "Stop 60"). Build, in a checkout:
 *   cc -O2 -D_GNU_SOURCE -Isrc/core -Isrc/index -o evict_driver \
 *      docs/data/review60/evict_driver.c src/index/kv_index.c build/lib/libkvcore.a \
 *      -lxxhash -lm -pthread
 */
/* eviction-heavy ingest: 16 MB table, N blocks stored in 16-block chained
 * events by 64 workers over a sliding window of 256-block documents. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#include "kv_index.h"
#include "kv_hash.h"
#include <xxhash.h>

#define CHUNK 16
#define REQ 256
static uint64_t W = 64;
static uint64_t rnd(uint64_t *s){ uint64_t x=*s+=0x9e3779b97f4a7c15ULL; x=(x^(x>>30))*0xbf58476d1ce4e5b9ULL; x=(x^(x>>27))*0x94d049bb133111ebULL; return x^(x>>31);}
static double cpu_s(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static double now_s(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
typedef struct { uint64_t doc; uint32_t h; } prog_t;
int main(int argc,char**argv){
    uint64_t nblocks = argc>1?strtoull(argv[1],0,10):5000000;
    size_t mb = argc>2?strtoull(argv[2],0,10):16;
    int rem = argc>3?atoi(argv[3]):0; uint64_t slide = argc>4?strtoull(argv[4],0,10):64, win = argc>5?strtoull(argv[5],0,10):512;   /* also remove: every 4th event removes a chunk tail-first */
    uint64_t nev = nblocks/CHUNK, i, seed=42; if(argc>6) W=strtoull(argv[6],0,10);
    kv_event_t *evs = calloc(nev,sizeof *evs);
    kv_stored_block_t *blk = malloc(nev*CHUNK*sizeof *blk);
    uint64_t *rm = malloc(nev*CHUNK*8);
    prog_t *prog = calloc(W*4096,sizeof *prog);
    uint64_t *hash = malloc(REQ*8), *toks = malloc(REQ*8);
    for(i=0;i<nev;i++){
        uint64_t base=i/slide, d=base+rnd(&seed)%win, w=rnd(&seed)%W, k, h;
        prog_t *p=&prog[w*4096+d%4096];
        if(p->doc!=d+1){p->doc=d+1;p->h=0;}
        /* doc hashes up to the end of chunk p->h (or p->h-1 when removing) */
        if(p->h==REQ/CHUNK && !rem){ p->h=0; }
        { uint64_t s=0,j,n=(p->h==REQ/CHUNK? p->h: p->h+1)*CHUNK; for(j=0;j<n;j++){ uint64_t t=(d*REQ+j)*0x2545F4914F6CDD1DULL+7; hash[j]= j==0? t: kv_hash_chain(s,t); s=hash[j]; toks[j]=t; } }
        if(p->h==REQ/CHUNK){ /* full: the engine evicts the deepest chunk, tail first */
            kv_event_t *ev=&evs[i]; memset(ev,0,sizeof *ev);
            ev->worker_id=w; ev->kind=KV_EVENT_REMOVED;
            p->h--;
            for(k=0;k<CHUNK;k++) rm[i*CHUNK+k]=hash[p->h*CHUNK+CHUNK-1-k];
            ev->hashes=&rm[i*CHUNK]; ev->n_hashes=CHUNK;
            continue;
        }
        h=p->h++;
        /* doc hashes */
        for(k=0;k<CHUNK;k++){ blk[i*CHUNK+k].block_hash=hash[h*CHUNK+k]; blk[i*CHUNK+k].tokens_hash=toks[h*CHUNK+k]; }
        kv_event_t *ev=&evs[i]; memset(ev,0,sizeof *ev);
        ev->worker_id=w; ev->kind=KV_EVENT_STORED; ev->has_parent=h>0; ev->parent_hash=h>0?hash[h*CHUNK-1]:0;
        ev->blocks=&blk[i*CHUNK]; ev->n_blocks=CHUNK;
    }
    (void)rm;
    kv_index_config_t cfg={.max_workers=(uint32_t)(W<64?64:W)}; char err[256];
    size_t size=mb<<20; void*r=aligned_alloc(2<<20,size); memset(r,0,size);
    kv_index_t*ix=kv_index_create(r,size,&cfg,err,sizeof err); if(!ix){fprintf(stderr,"%s\n",err);return 1;}
    uint64_t applied=0,fail=0; double t0=now_s(), c0=cpu_s();
    for(i=0;i<nev;i++){ if(kv_index_apply(ix,&evs[i],1000+i/1024,err,sizeof err)==0) applied+=evs[i].n_blocks+evs[i].n_hashes; else fail++; }
    double dt=now_s()-t0, dc=cpu_s()-c0; kv_index_stats_t st; kv_index_stats(ix,&st);
    printf("{\"cpu_blocks_per_s\":%.0f,\"blocks_per_s\":%.0f,\"s\":%.3f,\"applied\":%lu,\"fail\":%lu,\"cap\":%lu,\"held\":%lu,\"evicted\":%lu,\"holes\":%lu,\"lost\":%lu,\"removed\":%lu}\n",
        applied/dc,applied/dt,dt,applied,fail,st.capacity,st.blocks,st.evicted,st.holes,st.lost_slots,st.removed);
    if(getenv("SUM")) printf("region %016llx\n",(unsigned long long)XXH64(r,size,0));
    return 0;
}
