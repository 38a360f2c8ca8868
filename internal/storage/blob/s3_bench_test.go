package blob

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"golang.org/x/sys/unix"

	"stasis/internal/s3test"
)

// BenchmarkS3PackFile256MiB measures a 256 MiB pack (256 blobs of 1 MiB,
// as a microVM's saved state is stored) going to the versitygw server and
// coming back, against a baseline taken in the same run on the same file
// system: dd writing 256 MiB of zeros with an fsync, and reading them
// back. Upload is the pack file's Commit (a multipart upload in 16 MiB
// parts, 4 at once, then the index); download is a Get of every blob by
// a node with no read cache, 8 at once (as package cas restores), each a
// ranged GET verified against its key. Both sides read what was just
// written, so from the page cache. Run it once a count:
//
//	go test -run '^$' -bench S3PackFile256MiB -benchtime 1x -count 3 ./internal/storage/blob/
//
// It reports MB/s of each, the ratios s3-up/dd-write and s3-down/dd-read
// (throughputs: 1 is as fast as dd), and the CPU time the server and this
// process spent on the upload and download.
func BenchmarkS3PackFile256MiB(b *testing.B) {
	const size, chunk = 256 << 20, 1 << 20
	srv := s3test.Start(b)
	url := "s3://" + srv.Bucket(b) + "/bench"
	ctx := context.Background()
	data := noise(size, 256)
	keys := make([]string, size/chunk)
	for i := range keys {
		keys[i] = hashOf(data[i*chunk : (i+1)*chunk])
	}
	dd := filepath.Join(b.TempDir(), "dd")
	var ddW, ddR, up, down time.Duration
	var srvCPU, selfCPU time.Duration
	parts := ""
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		ddW += run(b, "dd", "if=/dev/zero", "of="+dd, "bs=1M", "count=256", "conv=fsync")
		ddR += run(b, "dd", "if="+dd, "of=/dev/null", "bs=1M")

		s := openS3(b, srv, url, S3Options{})
		pf, err := s.NewPackFile()
		if err != nil {
			b.Fatal(err)
		}
		if _, err := pf.File().Write(data); err != nil {
			b.Fatal(err)
		}
		for j, k := range keys {
			if err := pf.Keep(k, int64(j*chunk), chunk); err != nil {
				b.Fatal(err)
			}
		}
		srv0, self0 := procCPU(b, srv.Pid()), selfCPUTime()
		start := time.Now()
		if err := pf.Commit(ctx); err != nil {
			b.Fatal(err)
		}
		up += time.Since(start)
		parts = packParts(b, srv, s)

		reader := openS3(b, srv, url, S3Options{})
		start = time.Now()
		getAll(b, reader, keys, data, chunk)
		down += time.Since(start)
		srvCPU += procCPU(b, srv.Pid()) - srv0
		selfCPU += selfCPUTime() - self0

		if err := s.DeleteKeys(ctx, keys); err != nil {
			b.Fatal(err)
		}
		s.Close()
		reader.Close()
	}
	b.StopTimer()
	mbps := func(d time.Duration) float64 { return float64(b.N) * size / 1e6 / d.Seconds() }
	b.ReportMetric(mbps(ddW), "dd-write-MB/s")
	b.ReportMetric(mbps(ddR), "dd-read-MB/s")
	b.ReportMetric(mbps(up), "s3-up-MB/s")
	b.ReportMetric(mbps(down), "s3-down-MB/s")
	b.ReportMetric(mbps(up)/mbps(ddW), "up/dd-write")
	b.ReportMetric(mbps(down)/mbps(ddR), "down/dd-read")
	b.ReportMetric(srvCPU.Seconds()/float64(b.N), "server-cpu-s/op")
	b.ReportMetric(selfCPU.Seconds()/float64(b.N), "client-cpu-s/op")
	b.Logf("the pack went up as %s", parts)
}

// procCPU is the CPU time process pid has used (user and system), from
// /proc/PID/stat (in clock ticks, 100 a second on Linux).
func procCPU(b *testing.B, pid int) time.Duration {
	b.Helper()
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		b.Fatal(err)
	}
	f := strings.Fields(string(st[bytes.LastIndexByte(st, ')')+2:]))
	utime, _ := strconv.ParseInt(f[11], 10, 64) // fields 14 and 15 of stat
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(utime+stime) * 10 * time.Millisecond
}

// selfCPUTime is the CPU time this process has used.
func selfCPUTime() time.Duration {
	var ru unix.Rusage
	_ = unix.Getrusage(unix.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// run runs a command and returns how long it took.
func run(b *testing.B, name string, args ...string) time.Duration {
	b.Helper()
	start := time.Now()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		b.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, out)
	}
	return time.Since(start)
}

// getAll reads every blob, 8 at once, and checks it.
func getAll(b *testing.B, s *S3, keys []string, data []byte, chunk int) {
	b.Helper()
	jobs := make(chan int)
	errs := make(chan error, 8)
	var wg sync.WaitGroup
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range jobs {
				got, err := s.Get(context.Background(), keys[j])
				if err == nil && !bytes.Equal(got, data[j*chunk:(j+1)*chunk]) {
					err = ErrCorrupt
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	for j := range keys {
		jobs <- j
	}
	close(jobs)
	wg.Wait()
	close(errs)
	for err := range errs {
		b.Fatal(err)
	}
}

// packParts says how the store's one pack object went up: "a single PUT",
// or "a multipart upload of N parts" (its ETag's suffix).
func packParts(b *testing.B, srv *s3test.Server, s *S3) string {
	b.Helper()
	s.view.mu.RLock()
	var id string
	for pid := range s.view.packs {
		id = pid
	}
	s.view.mu.RUnlock()
	info, err := srv.Client(b).StatObject(context.Background(), s.loc.bucket, s.loc.prefix+packObject(id), minio.StatObjectOptions{})
	if err != nil {
		b.Fatal(err)
	}
	if _, n, ok := strings.Cut(info.ETag, "-"); ok {
		return "a multipart upload of " + n + " parts"
	}
	return "a single PUT"
}

// BenchmarkS3HasRefresh measures the listing a Has miss makes, on a store
// of 2,000 packs begun an hour ago (a collection's grace period keeps
// hours of them) and 20 begun now, with a ReuseWithin: "recent" lists
// the packs begun since the last listing (less recentMargin), as Has now
// does; "full" lists the whole store, as Has did before (the baseline,
// in the same run). Each refresh is forced (the last listing's time is
// cleared to the full one's).
//
//	go test -run '^$' -bench S3HasRefresh -benchtime 20x -count 3 ./internal/storage/blob/
func BenchmarkS3HasRefresh(b *testing.B) {
	srv := s3test.Start(b)
	url := "s3://" + srv.Bucket(b) + "/bench"
	ctx := context.Background()
	w := openS3(b, srv, url, S3Options{})
	put := func(n int, tag string) {
		var wg sync.WaitGroup
		sem := make(chan struct{}, 16)
		for i := range n {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				k, data := blobOf(tag+strconv.Itoa(i), 64)
				if err := w.Put(ctx, k, data); err != nil {
					b.Error(err)
				}
			})
		}
		wg.Wait()
	}
	packClock = func() time.Time { return time.Now().Add(-time.Hour) }
	put(2000, "old")
	packClock = time.Now
	put(20, "new")
	if b.Failed() {
		return
	}
	r := openS3(b, srv, url, S3Options{ReuseWithin: 30 * time.Minute})
	for _, recent := range []bool{true, false} {
		b.Run(map[bool]string{true: "recent", false: "full"}[recent], func(b *testing.B) {
			for b.Loop() {
				r.listMu.Lock()
				r.listedRecent = r.listed
				r.listMu.Unlock()
				if err := r.refreshWith(ctx, time.Now(), recent); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
