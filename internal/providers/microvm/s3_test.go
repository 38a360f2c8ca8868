package microvm_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"stasis/errdefs"
	"stasis/internal/providers/microvm"
	"stasis/internal/s3test"
	"stasis/internal/stasistest"
	"stasis/internal/storage/blob"
	"stasis/sandbox"
)

// s3Blobs starts (or shares) the test S3 server, points the AWS
// environment at it and returns a fresh bucket's URL for the providers'
// Options.Blobs, with the server and the bucket.
func s3Blobs(t testing.TB) (string, *s3test.Server, string) {
	t.Helper()
	srv := s3test.Start(t)
	srv.Setenv(t)
	bucket := srv.Bucket(t)
	return "s3://" + bucket + "/vms", srv, bucket
}

// objects lists the objects of bucket under prefix: name → size and
// ETag.
func objects(t *testing.T, srv *s3test.Server, bucket, prefix string) map[string]minio.ObjectInfo {
	t.Helper()
	out := map[string]minio.ObjectInfo{}
	for o := range srv.Client(t).ListObjects(ctx, bucket, minio.ListObjectsOptions{Prefix: prefix, Recursive: true}) {
		if o.Err != nil {
			t.Fatal(o.Err)
		}
		out[o.Key] = o
	}
	return out
}

// guestProcess is a process in the guest: its pid and its start time
// (field 22 of /proc/PID/stat), the identity a supervisor's is checked by
// after a restore.
func guestProcess(t *testing.T, p sandbox.Provider, id string) string {
	t.Helper()
	return strings.TrimSpace(sh(t, p, id, `pid=$(cat /tmp/pid); echo "$pid $(cut -d' ' -f22 /proc/$pid/stat)"`))
}

// count reads the guest's counter.
func count(t *testing.T, p sandbox.Provider, id string) int {
	t.Helper()
	n, err := strconv.Atoi(strings.TrimSpace(sh(t, p, id, "cat /tmp/count")))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// waitFor polls cond until it holds or a minute passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within a minute", what)
		}
		time.Sleep(50 * time.Millisecond) // poll interval, bounded by the deadline above
	}
}

// TestForkFromS3OnAnotherHome: a provider with its snapshots in S3
// snapshots a guest whose process keeps state in its memory alone (a
// counter in a shell variable, a token read from a file it then removed);
// the provider's state directory is then removed altogether, and a
// provider on another (another machine's, as far as the provider can
// tell) forks the snapshot: the process goes on in place, the same pid
// and start time, with its memory. Nothing of the state was stored in
// either state directory but the second's read cache; the second deletes
// the snapshot, which frees no blob of the shared bucket (they are within
// the grace period, and the fork's published base keeps them) and forks
// no more.
func TestForkFromS3OnAnotherHome(t *testing.T) {
	url, srv, bucket := s3Blobs(t)
	homeA := t.TempDir()
	a := newProvider(t, microvm.Options{Home: homeA, Blobs: url})
	src, err := a.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(10 * time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Delete(ctx, src.ID)
	token := fmt.Sprintf("token-%d", time.Now().UnixNano())
	if err := a.WriteFile(ctx, src.ID, "/tmp/token", []byte(token), 0o644); err != nil {
		t.Fatal(err)
	}
	// The process reads the token, removes the file, and writes the token
	// out again only when told to (SIGUSR1); meanwhile it counts.
	sh(t, a, src.ID, `setsid sh -c 'tok=$(cat /tmp/token); rm /tmp/token; trap "echo \$tok > /tmp/told" USR1; echo $$ > /tmp/pid.new; mv /tmp/pid.new /tmp/pid; i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done' </dev/null >/dev/null 2>&1 &
		until [ -s /tmp/count ] && [ -s /tmp/pid ]; do sleep 0.05; done`)
	ident := guestProcess(t, a, src.ID)
	if out := sh(t, a, src.ID, "ls /tmp/token 2>/dev/null || echo gone"); out != "gone\n" {
		t.Fatalf("the token file is still there: %q", out)
	}
	at := count(t, a, src.ID) // the snapshot comes later: it saves this or more
	snap, err := a.Snapshot(ctx, src.ID, "")
	if err != nil {
		t.Fatal(err)
	}
	if !snap.KeepsProcesses || snap.NewBytes <= 0 {
		t.Fatalf("snapshot info %+v", snap)
	}
	// The state went to S3, as one pack uploaded in parts (its ETag is
	// a multipart upload's), and the record beside it; nothing stayed in
	// the state directory.
	objs := objects(t, srv, bucket, "vms/")
	var packs []minio.ObjectInfo
	for name, o := range objs {
		if strings.HasSuffix(name, ".pack") {
			packs = append(packs, o)
		}
	}
	sort.Slice(packs, func(i, j int) bool { return packs[i].Size > packs[j].Size })
	if len(packs) == 0 || !strings.Contains(packs[0].ETag, "-") {
		t.Fatalf("the state's pack in S3: %+v", packs)
	}
	t.Logf("the state: %d bytes in %d packs, the largest %d bytes (ETag %s)", snap.Bytes, len(packs), packs[0].Size, packs[0].ETag)
	if _, ok := objs["vms/records/snapshots/microvm/"+snap.ID+".json"]; !ok {
		t.Fatalf("no record of %s among %d objects", snap.ID, len(objs))
	}
	if _, err := os.Stat(filepath.Join(homeA, "vmblobs")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a directory blob store in the state directory: %v", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(homeA, "vmblob-cache", "staging")); len(ents) != 0 {
		t.Fatalf("staging left: %v", ents)
	}

	// The first machine goes away, state directory and all.
	if err := a.Delete(ctx, src.ID); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(homeA); err != nil {
		t.Fatal(err)
	}

	homeB := t.TempDir()
	b := newProvider(t, microvm.Options{Home: homeB, Blobs: url})
	defer b.Close()
	got, err := b.GetSnapshot(ctx, snap.ID)
	if err != nil || !got.KeepsProcesses || got.Sandbox != src.ID {
		t.Fatalf("the snapshot as the other node sees it: %+v %v", got, err)
	}
	start := time.Now()
	forks, err := b.Fork(ctx, snap.ID, 1, sandbox.ForkSpec{Expiry: time.Now().Add(10 * time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("fork on the other node, its read cache cold: %s", time.Since(start).Round(time.Millisecond))
	f := forks[0].ID
	defer b.Delete(ctx, f)
	if got := guestProcess(t, b, f); got != ident {
		t.Fatalf("the process after the fork is %q, before it was %q: not resumed in place", got, ident)
	}
	first := count(t, b, f)
	if first < at {
		t.Fatalf("the counter went back from %d to %d", at, first)
	}
	waitFor(t, "the counter goes on", func() bool { return count(t, b, f) > first })
	sh(t, b, f, "kill -USR1 $(cat /tmp/pid)")
	waitFor(t, "the process writes its token", func() bool {
		return strings.TrimSpace(sh(t, b, f, "cat /tmp/told 2>/dev/null || true")) == token
	})
	ents, err := os.ReadDir(filepath.Join(homeB, "vmblob-cache", "blobs"))
	if err != nil || len(ents) == 0 {
		t.Fatalf("the state was not read through the node's cache: %v %v", ents, err)
	}

	// Deleting the shared snapshot frees no blob (new ones, which the
	// fork builds on besides) and refuses forks from then on.
	before := objects(t, srv, bucket, "vms/packs/")
	if err := b.DeleteSnapshot(ctx, snap.ID); err != nil {
		t.Fatal(err)
	}
	if n, _, err := b.CollectBlobs(ctx); err != nil || n != 0 {
		t.Fatalf("collect on a shared store: %d, %v", n, err)
	}
	if after := objects(t, srv, bucket, "vms/packs/"); len(after) != len(before) {
		t.Fatalf("packs %d before the delete, %d after", len(before), len(after))
	}
	if _, err := b.Fork(ctx, snap.ID, 1, sandbox.ForkSpec{Expiry: time.Now().Add(time.Minute)}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("fork of the deleted snapshot: %v", err)
	}
}

// TestForkFromS3WithDisks: a guest with read-only disks (an image root
// and a read-only bind) saved on one node forks on another after the
// first node's state directory and the bound directory are gone: the
// snapshot stored the disks in S3 and the second node writes them from
// there, once, so its process goes on in place and reads the files of
// both disks, including blocks the guest never read before.
func TestForkFromS3WithDisks(t *testing.T) {
	url, _, _ := s3Blobs(t)
	bound := t.TempDir()
	if err := os.WriteFile(filepath.Join(bound, "hello"), []byte("bound\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	homeA := t.TempDir()
	a := newProvider(t, microvm.Options{Home: homeA, Blobs: url, MemMiB: 256, ReadOnlyBinds: map[string]string{bound: "/opt/tools"}})
	src, err := a.Create(ctx, sandbox.Spec{Image: stasistest.BusyboxImage(t), Expiry: time.Now().Add(10 * time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Delete(ctx, src.ID)
	sh(t, a, src.ID, `setsid sh -c 'echo $$ > /tmp/pid.new; mv /tmp/pid.new /tmp/pid; i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done' </dev/null >/dev/null 2>&1 &
		until [ -s /tmp/count ] && [ -s /tmp/pid ]; do sleep 0.05; done`)
	ident := guestProcess(t, a, src.ID)
	snap, err := a.Snapshot(ctx, src.ID, "")
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Delete(ctx, src.ID); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	for _, dir := range []string{homeA, bound} {
		if err := os.RemoveAll(dir); err != nil {
			t.Fatal(err)
		}
	}

	homeB := t.TempDir()
	b := newProvider(t, microvm.Options{Home: homeB, Blobs: url})
	defer b.Close()
	for i := 0; i < 2; i++ {
		forks, err := b.Fork(ctx, snap.ID, 1, sandbox.ForkSpec{Expiry: time.Now().Add(10 * time.Minute)})
		if err != nil {
			t.Fatal(err)
		}
		f := forks[0].ID
		defer b.Delete(ctx, f)
		if got := guestProcess(t, b, f); got != ident {
			t.Fatalf("fork %d: the process is %q, before it was %q: not resumed in place", i, got, ident)
		}
		if got := sh(t, b, f, "cat /opt/tools/hello"); got != "bound\n" {
			t.Fatalf("fork %d: the bound file reads %q", i, got)
		}
		if got := sh(t, b, f, "cat /etc/os-release"); !strings.Contains(got, stasistest.BusyboxText) {
			t.Fatalf("fork %d: the image's /etc/os-release reads %q", i, got)
		}
		if got := sh(t, b, f, "cmp /bin/busybox /usr/bin/id && echo same"); got != "same\n" {
			t.Fatalf("fork %d: the image's busybox and its copy differ: %q", i, got)
		}
	}
	// Each disk was written on this node once, for both forks.
	disks, _ := filepath.Glob(filepath.Join(homeB, "vmdisks", "*.img"))
	if len(disks) != 2 {
		t.Fatalf("the disks written on the second node: %v, want the image's and the bind's", disks)
	}
}

// TestForkOfDamagedStateInS3: a saved state whose pack was damaged in
// the bucket (a byte changed, then the pack cut short) fails the fork on
// a node with a cold cache, with an error that says the blob is corrupt;
// the fork leaves no sandbox, no process and no sandbox directory.
func TestForkOfDamagedStateInS3(t *testing.T) {
	url, srv, bucket := s3Blobs(t)
	a := newProvider(t, microvm.Options{Blobs: url})
	defer a.Close()
	src, err := a.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(10 * time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Delete(ctx, src.ID)
	snap, err := a.Snapshot(ctx, src.ID, "")
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Delete(ctx, src.ID); err != nil {
		t.Fatal(err)
	}
	var largest string
	var size int64
	for name, o := range objects(t, srv, bucket, "vms/packs/") {
		if strings.HasSuffix(name, ".pack") && o.Size > size {
			largest, size = name, o.Size
		}
	}
	path := srv.ObjectPath(bucket, largest)

	homeB := t.TempDir()
	b := newProvider(t, microvm.Options{Home: homeB, Blobs: url})
	defer b.Close()
	for _, damage := range []struct {
		what string
		do   func() error
	}{
		{"a byte changed", func() error {
			f, err := os.OpenFile(path, os.O_RDWR, 0)
			if err != nil {
				return err
			}
			defer f.Close()
			one := make([]byte, 1)
			if _, err := f.ReadAt(one, size/2); err != nil {
				return err
			}
			one[0] ^= 0xff
			_, err = f.WriteAt(one, size/2)
			return err
		}},
		{"cut short", func() error { return os.Truncate(path, size/3) }},
	} {
		if err := damage.do(); err != nil {
			t.Fatal(err)
		}
		_, err := b.Fork(ctx, snap.ID, 1, sandbox.ForkSpec{Expiry: time.Now().Add(10 * time.Minute)})
		if !errors.Is(err, blob.ErrCorrupt) {
			t.Fatalf("%s: fork: %v, want an error wrapping %v", damage.what, err, blob.ErrCorrupt)
		}
		t.Logf("%s: %v", damage.what, err)
		if l, err := b.List(ctx, nil); err != nil || len(l) != 0 {
			t.Fatalf("%s: sandboxes after the failed fork: %v %v", damage.what, l, err)
		}
		if ents, _ := os.ReadDir(filepath.Join(homeB, "sandboxes", microvm.Name)); len(ents) != 0 {
			t.Fatalf("%s: sandbox directories left: %v", damage.what, ents)
		}
		if left := hostProcesses(homeB); len(left) != 0 {
			t.Fatalf("%s: processes left: %v", damage.what, left)
		}
	}
}

// TestConformanceWithS3: the whole provider suite on a provider whose
// snapshots are in S3 (about two minutes under TCG).
func TestConformanceWithS3(t *testing.T) {
	url, _, _ := s3Blobs(t)
	conformance(t, microvm.Options{Blobs: url})
}
