"""Scratch: in a SASS listing, the instructions of one loop (addresses LO..HI, hex): their count,
the first and last MUFU.EX2, and the position of every wait, barrier and mbarrier arrive."""
import re, sys
path, lo, hi = sys.argv[1], int(sys.argv[2], 16), int(sys.argv[3], 16)
lines=open(path).read().splitlines()
def addr(l):
    m=re.search(r'/\*([0-9a-f]{4,})\*/',l); return int(m.group(1),16) if m else None
sel=[l.split('*/')[1].split(';')[0].strip() for l in lines if addr(l) is not None and lo<=addr(l)<=hi]
mufu=[i for i,t in enumerate(sel) if 'MUFU.EX2' in t]
dep=[(i,t) for i,t in enumerate(sel) if 'DEPBAR' in t or 'BAR.SYNC' in t or 'SYNCS.ARRIVE' in t]
print(len(sel), 'MUFU', mufu[0], mufu[-1], dep)
