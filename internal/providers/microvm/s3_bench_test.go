package microvm_test

import (
	"testing"
	"time"

	"stasis/internal/providers/microvm"
	"stasis/sandbox"
)

// BenchmarkForkFromS3 measures, in one run, a fork of a microVM snapshot
// three ways, each the Fork call until the guest agent answers: from a
// directory store (the default: QEMU runs `stasis microvm state`); from
// S3 by a node whose read cache is cold (a fresh state directory, as
// another machine's); and from S3 again by that node, its cache now warm.
// The guests (256 MiB) have each written 96 MiB of random bytes into their
// RAM file system first, so that the state is mostly bytes no other
// snapshot shares. It reports the seconds of each and their ratios to the
// directory store's.
func BenchmarkForkFromS3(b *testing.B) {
	url, _, _ := s3Blobs(b)
	expiry := time.Now().Add(30 * time.Minute)
	saved := func(p *microvm.Provider) string {
		src, err := p.Create(ctx, sandbox.Spec{Expiry: expiry})
		if err != nil {
			b.Fatal(err)
		}
		sh(b, p, src.ID, "dd if=/dev/urandom of=/tmp/fill bs=1048576 count=96 2>/dev/null")
		snap, err := p.Snapshot(ctx, src.ID, "")
		if err != nil {
			b.Fatal(err)
		}
		if err := p.Delete(ctx, src.ID); err != nil {
			b.Fatal(err)
		}
		b.Logf("%s: %d bytes saved", snap.ID, snap.Bytes)
		return snap.ID
	}
	fork := func(p *microvm.Provider, snap string) time.Duration {
		start := time.Now()
		f, err := p.Fork(ctx, snap, 1, sandbox.ForkSpec{Expiry: expiry})
		took := time.Since(start)
		if err != nil {
			b.Fatal(err)
		}
		if err := p.Delete(ctx, f[0].ID); err != nil {
			b.Fatal(err)
		}
		return took
	}
	dir := newProvider(b, microvm.Options{MemMiB: 256})
	fromDir := saved(dir)
	saver := newProvider(b, microvm.Options{Blobs: url, MemMiB: 256})
	defer saver.Close()
	fromS3 := saved(saver)
	var dirT, coldT, warmT time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		node := newProvider(b, microvm.Options{Blobs: url, MemMiB: 256}) // a fresh state directory: a cold cache
		if err := node.Prepare(ctx); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		dirT += fork(dir, fromDir)
		coldT += fork(node, fromS3)
		warmT += fork(node, fromS3)
		b.StopTimer()
		if err := node.Close(); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	n := float64(b.N)
	b.ReportMetric(dirT.Seconds()/n, "dir-s")
	b.ReportMetric(coldT.Seconds()/n, "s3-cold-s")
	b.ReportMetric(warmT.Seconds()/n, "s3-warm-s")
	b.ReportMetric(coldT.Seconds()/dirT.Seconds(), "cold/dir")
	b.ReportMetric(warmT.Seconds()/dirT.Seconds(), "warm/dir")
}
