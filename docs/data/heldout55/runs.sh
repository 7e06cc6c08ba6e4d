#!/bin/sh
# The modules: /tmp/s55/main.so is main's build (16fddfb); speed.so and speed2.so are main
# with speed1.diff or speed2.diff (beside this file) applied, each built with `make module`
# and build/modules/ngx_http_kvroute_module.so copied aside. ts1 and ts2 ran the same way:
#   tools/bench-e2e --build build --suite --workloads conversation --slow-engines 4 \
#     --slow-factor 0.5 --rate-scale 0.75 --variant main=... --variant speed=... \
#     [--variant speed2=...] --policies kvroute@main,kvroute@speed   (ts2: speed2,main,speed)
# three more pairs: two-speed conversation (both orders), then equal engines: conversation, short, hotprefix
cd /work/main
V="--variant main=/tmp/s55/main.so --variant speed2=/tmp/s55/speed2.so"
B="tools/bench-e2e --build build --suite --no-plots"
$B --workloads conversation --slow-engines 4 --slow-factor 0.5 --rate-scale 0.75 $V --policies kvroute@main,kvroute@speed2 --out /tmp/s55/ts3
$B --workloads conversation --slow-engines 4 --slow-factor 0.5 --rate-scale 0.75 $V --policies kvroute@speed2,kvroute@main --out /tmp/s55/ts4
$B --workloads conversation,short,hotprefix $V --policies kvroute@main,kvroute@speed2 --out /tmp/s55/eq1
