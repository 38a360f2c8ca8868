package ledger

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"stasis/internal/pgtest"
)

// concurrentEpisodes is how many episodes append at once in
// BenchmarkAppendConcurrent: one gateway's load.
const concurrentEpisodes = 512

// BenchmarkAppendConcurrent measures ledger appends per second with 512
// episodes appending at once, each goroutine owning one episode's ledger
// and appending a chat completion of about 2 KB (the response of
// BenchmarkAppend) as fast as it returns, on the file ledger (one file per
// episode, fsync'd with group commit) and on PostgreSQL (group commit: the
// appends that arrive together go as one batch, one transaction) in the
// same run. The PostgreSQL server is the durable one (fsync on, as a
// production server), so that both wait for the disk; its data directory
// and the files' directory are both under the temporary directory, on the
// same file system. b.N is the total of appends, shared out evenly; the
// metrics are appends/s, the flushes (files: fsync or syncfs) or commits
// (postgres) per append, and, for postgres when files ran before it in the
// same process, postgres/files: the ratio of their appends/s.
func BenchmarkAppendConcurrent(b *testing.B) {
	resp := chat(strings.Repeat("some model output ", 100), "bash", `{"cmd":"go test ./..."}`)
	line, _, err := encodeRecord(entryRecord(entry("ep0000/1", resp)))
	if err != nil {
		b.Fatal(err)
	}
	var filesRate float64
	b.Run("files", func(b *testing.B) {
		ls := openConcurrent(b, Files(b.TempDir()))
		flushes0, writes0 := Flushes()
		rate := appendConcurrent(b, ls, resp, int64(len(line)+1))
		flushes, writes := Flushes()
		b.ReportMetric(float64(flushes-flushes0)/float64(writes-writes0), "flushes/append")
		filesRate = rate
	})
	b.Run("postgres", func(b *testing.B) {
		p, err := OpenPostgres(context.Background(), pgtest.DurableDSN(b))
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(p.Close)
		ls := openConcurrent(b, p)
		commits0, appends0 := p.Commits()
		rate := appendConcurrent(b, ls, resp, int64(len(line)+1))
		commits, appends := p.Commits()
		b.ReportMetric(float64(commits-commits0)/float64(appends-appends0), "commits/append")
		if filesRate > 0 {
			b.ReportMetric(rate/filesRate, "postgres/files")
		}
	})
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
	for _, err := range errs {
		if err != nil {
			b.Fatal(err)
		}
	}
	return ls
}

// appendConcurrent makes b.N appends of resp, shared out over the ledgers
// ls, each appended to by a goroutine of its own, all at once; it reports
// and returns appends/s. size is the bytes one append writes.
func appendConcurrent(b *testing.B, ls []*Ledger, resp []byte, size int64) float64 {
	b.Helper()
	b.SetBytes(size)
	var (
		start = make(chan struct{})
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	for i, l := range ls {
		n := b.N / len(ls)
		if i < b.N%len(ls) {
			n++
		}
		wg.Go(func() {
			<-start
			for j := range n {
				if _, err := l.Append(entry(fmt.Sprintf("%s/%d", l.Episode(), j+1), resp)); err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
					return
				}
			}
		})
	}
	b.ResetTimer()
	close(start)
	wg.Wait()
	b.StopTimer()
	if first != nil {
		b.Fatal(first)
	}
	rate := float64(b.N) / b.Elapsed().Seconds()
	b.ReportMetric(rate, "appends/s")
	return rate
}
