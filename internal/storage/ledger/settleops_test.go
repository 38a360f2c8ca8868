package ledger

import (
	"bytes"
	"fmt"
	"iter"
	"strings"
	"testing"
)

// scriptOps reads a fuzz script as operations: each an operation (its
// byte modulo kinds) and its argument (the next byte; 0 at the end).
func scriptOps(script []byte, kinds byte) iter.Seq2[byte, int] {
	return func(yield func(byte, int) bool) {
		for i := 0; i < len(script); i += 2 {
			arg := 0
			if i+1 < len(script) {
				arg = int(script[i+1])
			}
			if !yield(script[i]%kinds, arg) {
				return
			}
		}
	}
}

// ment is a fuzz test's model of one ledger entry: its call id, its
// disposition, and whether a settlement named it.
type ment struct {
	id      string
	d       Disposition
	settled bool
}

// FuzzSettleOps drives a ledger with a script of appends, settlements
// (good and bad) and cuts, and holds it to a model: every entry's
// disposition, the dropped ones, DeliveredBefore and the counts Verify
// gives, after a reopen too. A refused or repeated settlement must leave
// the file as it was.
func FuzzSettleOps(f *testing.F) {
	f.Add([]byte{0, 0, 0, 1, 0, 2, 1, 3, 5, 2, 0})
	f.Add([]byte{0, 0, 1, 0, 1, 1, 1, 0, 3, 1, 0, 3, 4, 0, 2, 1, 1, 0})
	f.Add([]byte{0, 0, 0, 0, 0, 4, 1, 65, 2, 3, 1, 130, 2, 64, 0, 1, 7})
	f.Add([]byte{0, 0, 0, 0, 1, 64, 1, 65, 3, 1, 0, 0, 1, 1, 1, 65, 3, 0})
	f.Fuzz(func(t *testing.T, script []byte) {
		if len(script) > 64 {
			return
		}
		var live, dropped []ment
		dir := t.TempDir()
		l, err := Open(dir, "ep")
		if err != nil {
			t.Fatal(err)
		}
		defer func() { l.Close() }()
		next := 0
		for op, arg := range scriptOps(script, 4) {
			switch op {
			case 0: // append
				next++
				id := fmt.Sprintf("ep/%d", next)
				e, err := l.Append(entry(id, chat(id)))
				if err != nil {
					t.Fatal(err)
				}
				live = append(live, ment{id: id, d: Pending})
				if e.Seq != int64(len(live)) || e.Disposition != Pending {
					t.Fatalf("append: %+v", e)
				}
			case 1, 2: // settle one entry: arg picks it, the disposition, and a wrong call id
				if len(live) == 0 {
					continue
				}
				k := arg % len(live)
				d := Delivered
				if arg&64 != 0 {
					d = Abandoned
				}
				id := live[k].id
				if arg&128 != 0 {
					id += "x"
				}
				ok := id == live[k].id && (!live[k].settled || live[k].d == d)
				before := fileBytes(t, dir, "ep")
				err := l.Settle(Settlement{int64(k + 1), id, d})
				if (err == nil) != ok {
					t.Fatalf("Settle(%d, %s, %s) of %+v: %v", k+1, id, d, live[k], err)
				}
				if err != nil || live[k].settled {
					if !bytes.Equal(before, fileBytes(t, dir, "ep")) {
						t.Fatal("a refused or repeated settlement wrote something")
					}
					continue
				}
				live[k].d, live[k].settled = d, true
			case 3: // cut
				pos := arg % (len(live) + 1)
				if err := l.Cut(int64(pos), "fuzz"); err != nil {
					t.Fatal(err)
				}
				for _, m := range live[pos:] {
					if !m.settled {
						m.d = Undelivered
					}
					dropped = append(dropped, m)
				}
				live = live[:pos]
			}
		}
		var wantLive []string
		for i, m := range live {
			wantLive = append(wantLive, fmt.Sprintf("%d:%s:%s", i+1, m.id, m.d))
		}
		check := func(what string, es []Entry) {
			t.Helper()
			if got, want := dispositions(es), strings.Join(wantLive, " "); got != want {
				t.Fatalf("%s: %s, want %s", what, got, want)
			}
		}
		check("entries", l.Entries())
		for seq := int64(0); seq <= int64(len(live))+1; seq++ {
			var want int64
			for _, m := range live[:max(min(seq-1, int64(len(live))), 0)] {
				if m.d != Abandoned {
					want++
				}
			}
			if n := l.DeliveredBefore(seq); n != want {
				t.Fatalf("DeliveredBefore(%d) = %d, want %d", seq, n, want)
			}
		}
		l.Close()
		if l, err = Open(dir, "ep"); err != nil {
			t.Fatal(err)
		}
		check("after reopen", l.Entries())
		if len(live)+len(dropped) == 0 {
			return // no record was written: no file to read
		}
		h, err := Read(dir, "ep")
		if err != nil {
			t.Fatal(err)
		}
		check("read", h.Entries)
		var gotDropped, wantDropped []string
		for _, e := range h.Dropped {
			gotDropped = append(gotDropped, e.CallID+":"+string(e.Disposition))
		}
		counts := map[Disposition]int64{}
		for _, m := range dropped {
			wantDropped = append(wantDropped, m.id+":"+string(m.d))
			counts[m.d]++
		}
		for _, m := range live {
			counts[m.d]++
		}
		if fmt.Sprint(gotDropped) != fmt.Sprint(wantDropped) {
			t.Fatalf("dropped %v, want %v", gotDropped, wantDropped)
		}
		rep, err := Verify(dir, "ep")
		if err != nil || !rep.OK || rep.Delivered != counts[Delivered] || rep.Abandoned != counts[Abandoned] ||
			rep.Pending != counts[Pending] || rep.Undelivered != counts[Undelivered] || rep.Live != int64(len(live)) {
			t.Fatalf("verify %+v %v, want counts %v", rep, err, counts)
		}
	})
}
