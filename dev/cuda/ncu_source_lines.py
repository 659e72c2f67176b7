#!/usr/bin/env python3
"""dev/cuda/ncu_source_lines.py: Nsight Compute's per-SASS-instruction warp samples (the CSV of
`ncu --import R --page source --csv --print-source sass`, optionally .xz, as dev/cuda/run_rev.sh
writes it) summed per source line, with each line's top stall reasons. The CSV's addresses are
absolute: they are taken relative to the first row and matched to the offsets of `nvdisasm -g -c`
of the same binary's cubin (cuobjdump -xelf <name>.sm_90.cubin <binary>), whose line-info comments
name the source lines; FUNC is the mangled kernel name as nvdisasm prints it.
Usage: ncu_source_lines.py CSV[.xz] SASS FUNC [ROWS]"""
import csv, io, lzma, re, sys, collections
path, sass, func = sys.argv[1], sys.argv[2], sys.argv[3]
txt = lzma.open(path, 'rt').read().splitlines()
rows = list(csv.reader(io.StringIO('\n'.join(txt[1:]))))
hdr = rows[0]; rows = rows[1:]
ia, isrc = hdr.index('Address'), hdr.index('Source')
iall = hdr.index('Warp Stall Sampling (All Samples)')
st = [i for i, h in enumerate(hdr) if h.startswith('stall_') and 'Not Issued' not in h]
iex = hdr.index('Instructions Executed')
base = int(rows[0][ia], 16)
fn = None; cur = None; amap = {}
for l in open(sass):
    m = re.search(r'\.text\.(\S+):', l)
    if m: fn = m.group(1)
    m = re.search(r'File "([^"]+)", line (\d+)', l)
    if m: cur = (m.group(1).split('/')[-1][:22], int(m.group(2))); continue
    if fn != func: continue
    m = re.search(r'/\*([0-9a-f]{4,})\*/\s+(.*?);', l)
    if m: amap[int(m.group(1), 16)] = (cur, m.group(2).strip())
def num(x):
    try: return float(x.replace(',', ''))
    except: return 0.0
tot = collections.Counter(); per = collections.defaultdict(collections.Counter); ex = collections.Counter()
mism = 0; ins = []
for r in rows:
    off = int(r[ia], 16) - base
    src, s2 = amap.get(off, (('?', 0), ''))
    if s2 and s2.split()[0] not in r[isrc]: mism += 1
    a = num(r[iall]); per[src]['all'] += a; tot['all'] += a; ex[src] += num(r[iex])
    for i in st:
        v = num(r[i]); tot[hdr[i]] += v; per[src][hdr[i]] += v
    ins.append((a, off, src, r[isrc].strip()[:50], max(((num(r[i]), hdr[i][6:]) for i in st))))
print('mismatched', mism, 'of', len(rows))
print('TOTAL', tot['all'], ' '.join(f'{k[6:]}={v/tot["all"]*100:.1f}%' for k, v in tot.most_common() if k != 'all' and v > 0.005 * tot['all']))
print('--- source lines by samples (top reasons)')
for k, v in sorted(per.items(), key=lambda x: -x[1]['all'])[:int(sys.argv[4]) if len(sys.argv) > 4 else 50]:
    top = ' '.join(f'{kk[6:]}:{vv:.0f}' for kk, vv in v.most_common(5) if kk != 'all')
    print(f'{k[0]:22s}{k[1]:5d} {v["all"]:8.0f} {v["all"]/tot["all"]*100:5.1f}% ex={ex[k]:9.0f} | {top}')
