package ledger

import (
	"fmt"
	"slices"
	"strings"
	"testing"
)

// FuzzBranchOps drives a ledger with a script of appends, settlements,
// cuts, tips taken (checkpoints) and branches back to them (restores of
// those checkpoints), and holds it to a model: after a branch the logical
// ledger is what it was at that tip, each entry with its disposition
// then. The ledger as written, as opened again and as loaded by going
// back to each branch's record by loading the bytes up to there must all
// agree, and HistoryAt must agree with EntriesAt at every record.
func FuzzBranchOps(f *testing.F) {
	f.Add([]byte{0, 0, 0, 0, 3, 0, 2, 1, 0, 0, 4, 0})
	f.Add([]byte{0, 0, 3, 0, 2, 0, 0, 0, 3, 0, 2, 1, 0, 0, 4, 1, 0, 0, 4, 0, 1, 65})
	f.Add([]byte{0, 0, 1, 0, 3, 0, 2, 0, 4, 0, 0, 0, 3, 0, 2, 0, 4, 1, 4, 0, 4, 1})
	f.Fuzz(func(t *testing.T, script []byte) {
		if len(script) > 80 {
			return
		}
		dir := t.TempDir()
		l, err := Open(dir, "ep")
		if err != nil {
			t.Fatal(err)
		}
		defer func() { l.Close() }()
		var live []ment
		type tip struct {
			hash string
			live []ment
		}
		var tips []tip
		next := 0
		for op, arg := range scriptOps(script, 5) {
			switch op {
			case 0: // append
				next++
				id := fmt.Sprintf("ep/%d", next)
				mustAppend(t, l, entry(id, chat(id)))
				live = append(live, ment{id: id, d: Pending})
			case 1: // settle an unsettled entry
				if len(live) == 0 || live[arg%len(live)].settled {
					continue
				}
				k := arg % len(live)
				d := Delivered
				if arg&64 != 0 {
					d = Abandoned
				}
				if err := l.Settle(Settlement{int64(k + 1), live[k].id, d}); err != nil {
					t.Fatal(err)
				}
				live[k].d, live[k].settled = d, true
			case 2: // cut
				pos := arg % (len(live) + 1)
				if err := l.Cut(int64(pos), "fuzz"); err != nil {
					t.Fatal(err)
				}
				live = live[:pos:pos]
			case 3: // a checkpoint: the tip, once the ledger has a record
				if tp := l.Tip(); tp.Hash != "" {
					tips = append(tips, tip{tp.Hash, slices.Clone(live)})
				}
			case 4: // a restore of a checkpoint taken before
				if len(tips) == 0 {
					continue
				}
				to := tips[arg%len(tips)]
				if err := l.Branch(to.hash, "fuzz"); err != nil {
					t.Fatal(err)
				}
				live = slices.Clone(to.live)
			}
		}
		var want []string
		for i, m := range live {
			want = append(want, fmt.Sprintf("%d:%s:%s", i+1, m.id, m.d))
		}
		check := func(what string, es []Entry) {
			t.Helper()
			if got := dispositions(es); got != strings.Join(want, " ") {
				t.Fatalf("%s: %s, want %s", what, got, strings.Join(want, " "))
			}
		}
		check("entries", l.Entries())
		if l.Tip().Records < 2 {
			return // nothing, or a header only
		}
		checkHistoryAt(t, l, Files(dir))
		l.Close()
		if l, err = Open(dir, "ep"); err != nil {
			t.Fatal(err)
		}
		check("after reopen", l.Entries())
		checkOneWalk(t, fileBytes(t, dir, "ep"))
	})
}
