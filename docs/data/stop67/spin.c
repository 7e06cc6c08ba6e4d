#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now_s(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec/1e9;}
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){ size_t n=2000000,i; double *l=malloc(n*sizeof(double)); volatile double s=0; int spin=atoi(argv[1]);
 for(i=0;i<n;i++){double t0=now_s(); for(int k=0;k<spin;k++) s+=k*0.5; l[i]=(now_s()-t0)*1e6;}
 qsort(l,n,sizeof(double),cmp); double q[]={.5,.9,.97,.98,.99,.995,.999}; for(int k=0;k<7;k++) printf("q%.3f=%.3f ",q[k],l[(size_t)(n*q[k])]); printf("\n");}
