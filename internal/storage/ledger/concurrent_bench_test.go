package ledger

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"stasis/internal/pgtest"
)

const (
	// concurrentEpisodes is how many episodes append at once in
	// BenchmarkAppendConcurrent: one gateway's load.
	concurrentEpisodes = 512
	// roundPerEpisode is how many appends each episode makes in one round
	// of BenchmarkAppendConcurrent before the other storage has its turn.
	roundPerEpisode = 10
)

// BenchmarkAppendConcurrent measures ledger appends per second with 512
// episodes appending at once, each goroutine owning one episode's ledger
// and appending a chat completion of about 2 KB (the response of
// BenchmarkAppend) as soon as its last append returned, on the file ledger
// (one file per episode, fsync'd with group commit) and on PostgreSQL
// (group commit: the appends that arrive together go as one batch, one
// transaction), in the same run. The PostgreSQL server is the durable one
// (fsync on, as a production server's), so that both wait for the disk;
// its data directory and the files' directory are both under the
// temporary directory, on the same file system.
//
// b.N is the appends made on each storage. The machine is shared and its
// load moves, so the two take turns in rounds (each episode appends 10
// entries on one storage, then 10 on the other; who goes first
// alternates), and each storage's rate is its appends over the time of its
// own rounds: both see the same load, and their ratio holds when the
// absolute figures move. ns/op is the time of both per append. Metrics:
// files-appends/s, postgres-appends/s, postgres/files (the ratio of those
// rates), files-flushes/append (fsync or syncfs calls per append),
// postgres-commits/append (transactions per append), and B/append (the
// bytes one append writes).
func BenchmarkAppendConcurrent(b *testing.B) {
	resp := chat(strings.Repeat("some model output ", 100), "bash", `{"cmd":"go test ./..."}`)
	line, _, err := encodeRecord(entryRecord(entry("ep0000/1", resp)))
	if err != nil {
		b.Fatal(err)
	}
	p, err := OpenPostgres(context.Background(), pgtest.DurableDSN(b))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(p.Close)
	type side struct {
		ls   []*Ledger
		next []int // each ledger's appends so far
		took time.Duration
	}
	files := &side{ls: openConcurrent(b, Files(b.TempDir()))}
	pg := &side{ls: openConcurrent(b, p)}
	for _, s := range []*side{files, pg} {
		s.next = make([]int, len(s.ls))
	}
	flushes0, writes0 := Flushes()
	commits0, appends0 := p.Commits()
	b.ResetTimer()
	for done, round := 0, 0; done < b.N; round++ {
		n := min(concurrentEpisodes*roundPerEpisode, b.N-done)
		order := []*side{files, pg}
		if round%2 == 1 {
			order = []*side{pg, files}
		}
		for _, s := range order {
			start := time.Now()
			err := appendRound(s.ls, s.next, n, resp)
			s.took += time.Since(start)
			if err != nil {
				b.Fatal(err)
			}
		}
		done += n
	}
	b.StopTimer()
	flushes, writes := Flushes()
	commits, appends := p.Commits()
	filesRate := float64(b.N) / files.took.Seconds()
	pgRate := float64(b.N) / pg.took.Seconds()
	b.ReportMetric(filesRate, "files-appends/s")
	b.ReportMetric(pgRate, "postgres-appends/s")
	b.ReportMetric(pgRate/filesRate, "postgres/files")
	b.ReportMetric(float64(flushes-flushes0)/float64(writes-writes0), "files-flushes/append")
	b.ReportMetric(float64(commits-commits0)/float64(appends-appends0), "postgres-commits/append")
	b.ReportMetric(float64(len(line)+1), "B/append")
}

// openConcurrent opens the ledgers of concurrentEpisodes episodes in s.
func openConcurrent(b *testing.B, s Storage) []*Ledger {
	b.Helper()
	ls := make([]*Ledger, concurrentEpisodes)
	errs := make([]error, concurrentEpisodes)
	var wg sync.WaitGroup
	for i := range ls {
		wg.Go(func() { ls[i], errs[i] = OpenIn(s, fmt.Sprintf("ep%04d", i)) })
	}
	wg.Wait()
	b.Cleanup(func() {
		for _, l := range ls {
			if l != nil {
				l.Close()
			}
		}
	})
	if err := errors.Join(errs...); err != nil {
		b.Fatal(err)
	}
	return ls
}

// appendRound makes n appends of resp, shared out evenly over the ledgers
// ls, each appended to by a goroutine of its own, all at once; next counts
// each ledger's appends, which number its call ids.
func appendRound(ls []*Ledger, next []int, n int, resp []byte) error {
	var (
		wg   sync.WaitGroup
		errs = make([]error, len(ls))
	)
	for i, l := range ls {
		k := n / len(ls)
		if i < n%len(ls) {
			k++
		}
		wg.Go(func() {
			for range k {
				next[i]++
				if _, err := l.Append(entry(fmt.Sprintf("%s/%d", l.Episode(), next[i]), resp)); err != nil {
					errs[i] = err
					return
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}
