package bench

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
)

func TestSnapshotSmallTree(t *testing.T) {
	scratch := t.TempDir()
	var progress bytes.Buffer
	res, err := Snapshot(context.Background(), SnapshotOptions{Dir: scratch, TreeMiB: 4, ChangedPercent: 2, Progress: &progress})
	if err != nil {
		t.Fatal(err)
	}
	if res.TreeBytes != 4<<20 || res.Files < 20 || res.Dirs < 10 {
		t.Fatalf("tree: %d bytes, %d files, %d dirs", res.TreeBytes, res.Files, res.Dirs)
	}
	if res.ChangedFiles == 0 || res.ChangedBytes < res.TreeBytes/100 || res.ChangedBytes > res.TreeBytes/20 {
		t.Fatalf("changed %d files, %d bytes, for 2%% of %d", res.ChangedFiles, res.ChangedBytes, res.TreeBytes)
	}
	if len(res.Rows) != 5 {
		t.Fatalf("%d rows: %+v", len(res.Rows), res.Rows)
	}
	first, inc, cp, tar, fork := res.Rows[0], res.Rows[1], res.Rows[2], res.Rows[3], res.Rows[4]
	for _, r := range res.Rows {
		if r.Duration <= 0 || r.BytesWritten <= 0 {
			t.Errorf("row %q: %+v", r.What, r)
		}
	}
	// Random content does not deduplicate: the first snapshot stores the
	// whole tree, plus its manifest.
	if first.ReadBytes != res.TreeBytes || first.BytesWritten <= res.TreeBytes || first.BytesWritten > res.TreeBytes+res.TreeBytes/10 {
		t.Errorf("first snapshot read %d, wrote %d, of a %d-byte tree", first.ReadBytes, first.BytesWritten, res.TreeBytes)
	}
	// What a snapshot says it wrote is what the store grew by, but for
	// the pack's index: 32 bytes of key and two short numbers a blob,
	// and a header and checksum.
	for _, r := range []SnapshotRow{first, inc} {
		over := r.DirGrowth - r.BytesWritten
		if over < 0 || over > 64*int64(r.NewBlobs)+128 {
			t.Errorf("%s: wrote %d bytes (%d blobs), the store grew by %d", r.What, r.BytesWritten, r.NewBlobs, r.DirGrowth)
		}
	}
	// The incremental snapshot reads at least the changed bytes (files
	// written just before the first snapshot are read again, unchanged) and
	// writes new chunks for the changed files only.
	final := res.ChangedTreeBytes
	if final < res.TreeBytes || final > res.TreeBytes+res.ChangedBytes {
		t.Errorf("tree of %d bytes is %d after changing %d", res.TreeBytes, final, res.ChangedBytes)
	}
	if inc.ReadBytes < res.ChangedBytes || inc.ReadBytes > final || inc.BytesWritten >= first.BytesWritten/5 || inc.ReusedFiles+res.ChangedFiles > res.Files {
		t.Errorf("incremental: %+v after changing %d bytes in %d files", inc, res.ChangedBytes, res.ChangedFiles)
	}
	// The baselines copy the whole changed tree; the fork restores it.
	if cp.BytesWritten != final || tar.BytesWritten < final || fork.BytesWritten != final || fork.DirGrowth != final {
		t.Errorf("cp wrote %d, tar %d, fork %d/%d; the tree is %d bytes", cp.BytesWritten, tar.BytesWritten, fork.BytesWritten, fork.DirGrowth, final)
	}
	if res.CpBytesRatio != float64(cp.BytesWritten)/float64(inc.BytesWritten) || res.TarTimeRatio != float64(tar.Duration)/float64(inc.Duration) {
		t.Errorf("ratios do not follow the rows: %+v", res)
	}
	if res.Target != SnapshotTarget || res.MeetsTarget != (res.CpTimeRatio >= SnapshotTarget && res.CpBytesRatio >= SnapshotTarget) {
		t.Errorf("verdict: %+v", res)
	}
	if !strings.Contains(progress.String(), "incremental snapshot") {
		t.Errorf("no progress: %q", progress.String())
	}
	ents, err := os.ReadDir(scratch)
	if err != nil || len(ents) != 0 {
		t.Fatalf("scratch directory left holding %v (%v)", ents, err)
	}
}

func TestSnapshotRefusesBadOptions(t *testing.T) {
	for _, o := range []SnapshotOptions{{TreeMiB: -1}, {ChangedPercent: 101}, {ChangedPercent: -2}} {
		o.Dir = t.TempDir()
		if _, err := Snapshot(context.Background(), o); err == nil {
			t.Errorf("options %+v accepted", o)
		}
	}
}
