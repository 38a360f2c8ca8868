package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"stasis/internal/storage/atomicfile"
	"stasis/internal/storage/blob"
	"stasis/internal/storage/cas"
)

// SnapshotOptions configure Snapshot.
type SnapshotOptions struct {
	Dir            string  // scratch space; a new directory is made in it and removed after (default: the system's temporary directory)
	TreeMiB        int     // size of the generated tree (default 200)
	ChangedPercent float64 // share of the tree's bytes changed before the incremental snapshot (default 1)
	Progress       io.Writer
}

// SnapshotRow is one measured way of saving (or forking) the tree.
type SnapshotRow struct {
	What     string        `json:"what"`
	Duration time.Duration `json:"duration_ns"`
	// BytesWritten: for a snapshot, the bytes it wrote to the blob store
	// (Stats.NewBytes); for a copy, archive or restore, the size of what it
	// made.
	BytesWritten int64 `json:"bytes_written"`
	// DirGrowth is how much the directory written to grew, by a walk
	// summing file sizes: the blob store for snapshots, the copy, archive or
	// fork otherwise.
	DirGrowth   int64 `json:"dir_growth_bytes"`
	ReadBytes   int64 `json:"read_bytes"` // file bytes the snapshot read (restore: chunk bytes)
	NewBlobs    int   `json:"new_blobs,omitempty"`
	ReusedFiles int   `json:"reused_files,omitempty"`
}

// SnapshotResult is what Snapshot measured.
type SnapshotResult struct {
	TreeBytes      int64   `json:"tree_bytes"`
	Files          int     `json:"files"`
	Dirs           int     `json:"dirs"`
	ChangedPercent float64 `json:"changed_percent"`
	ChangedFiles   int     `json:"changed_files"`
	ChangedBytes   int64   `json:"changed_bytes"` // bytes rewritten or appended
	// ChangedTreeBytes is the tree's size after the change (appends grow it):
	// what the baselines copy.
	ChangedTreeBytes int64 `json:"changed_tree_bytes"`
	// Rows: first snapshot, incremental snapshot, cp -a, tar -cf, restore.
	Rows []SnapshotRow `json:"rows"`
	// Ratios of each baseline's cost to the incremental snapshot's, in time
	// and in bytes written: how many times cheaper the snapshot is.
	CpTimeRatio   float64 `json:"cp_time_over_incremental"`
	CpBytesRatio  float64 `json:"cp_bytes_over_incremental"`
	TarTimeRatio  float64 `json:"tar_time_over_incremental"`
	TarBytesRatio float64 `json:"tar_bytes_over_incremental"`
	// Target is the ratio the incremental snapshot must reach against cp -a,
	// in time and in bytes; MeetsTarget says whether it did.
	Target      float64 `json:"target"`
	MeetsTarget bool    `json:"meets_target"`
}

// SnapshotTarget: a snapshot after a 1% change must cost at least ten times
// less than cp -a of the tree, in time and in bytes.
const SnapshotTarget = 10

// Snapshot measures the content-addressed tree store on a generated tree:
// a first snapshot, then, after changing a share of the tree's bytes, an
// incremental one; beside them, in the same run on the same changed tree,
// cp -a and tar -cf as real commands, and a restore (a fork) of the
// incremental snapshot. Before each step the scratch file system is synced
// so that no step pays for another's writes, and nothing is deleted until
// the end (on ext4, creating files soon after deleting many is slower);
// the snapshots fsync what they write, the baselines do not (in their
// favour).
func Snapshot(ctx context.Context, o SnapshotOptions) (res SnapshotResult, err error) {
	if err := o.check(); err != nil {
		return res, err
	}
	scratch, err := os.MkdirTemp(o.Dir, "stasis-bench-snapshot-")
	if err != nil {
		return res, fmt.Errorf("scratch directory: %w", err)
	}
	defer func() {
		if rerr := os.RemoveAll(scratch); rerr != nil && err == nil {
			err = fmt.Errorf("remove scratch directory: %w", rerr)
		}
	}()
	res.ChangedPercent = o.ChangedPercent
	res.Target = SnapshotTarget
	tree := filepath.Join(scratch, "tree")
	storeDir := filepath.Join(scratch, "store")

	fmt.Fprintf(o.Progress, "snapshot: generating a %d MiB tree in %s ...\n", o.TreeMiB, scratch)
	files, dirs, err := generateTree(tree, int64(o.TreeMiB)<<20)
	if err != nil {
		return res, fmt.Errorf("generate tree: %w", err)
	}
	res.Files, res.Dirs = len(files), dirs
	for _, f := range files {
		res.TreeBytes += f.size
	}
	bd, err := blob.NewDir(storeDir)
	if err != nil {
		return res, err
	}
	store := cas.New(bd)

	fmt.Fprintf(o.Progress, "snapshot: first snapshot of %d files ...\n", len(files))
	row, id1, err := measureSnapshot(ctx, store, storeDir, tree, "", "snapshot (first)")
	if err != nil {
		return res, err
	}
	res.Rows = append(res.Rows, row)

	res.ChangedFiles, res.ChangedBytes, err = changeTree(files, o.ChangedPercent)
	if err != nil {
		return res, fmt.Errorf("change tree: %w", err)
	}
	for _, f := range files {
		res.ChangedTreeBytes += f.size
	}
	fmt.Fprintf(o.Progress, "snapshot: changed %d files (%d bytes); incremental snapshot ...\n", res.ChangedFiles, res.ChangedBytes)
	inc, id2, err := measureSnapshot(ctx, store, storeDir, tree, id1, "snapshot (incremental)")
	if err != nil {
		return res, err
	}
	res.Rows = append(res.Rows, inc)

	fmt.Fprintf(o.Progress, "snapshot: restore (fork) of the incremental snapshot ...\n")
	fork, err := measureFork(ctx, store, scratch, id2)
	if err != nil {
		return res, err
	}

	cp, tar, err := measureBaselines(ctx, o.Progress, scratch, &res)
	if err != nil {
		return res, err
	}
	res.Rows = append(res.Rows, fork)

	res.CpTimeRatio = snapshotRatio(float64(cp.Duration), float64(inc.Duration))
	res.CpBytesRatio = snapshotRatio(float64(cp.BytesWritten), float64(inc.BytesWritten))
	res.TarTimeRatio = snapshotRatio(float64(tar.Duration), float64(inc.Duration))
	res.TarBytesRatio = snapshotRatio(float64(tar.BytesWritten), float64(inc.BytesWritten))
	res.MeetsTarget = res.CpTimeRatio >= SnapshotTarget && res.CpBytesRatio >= SnapshotTarget
	return res, nil
}

// check fills in the defaults and checks the options and the baselines'
// commands.
func (o *SnapshotOptions) check() error {
	if o.TreeMiB == 0 {
		o.TreeMiB = 200
	}
	if o.ChangedPercent == 0 {
		o.ChangedPercent = 1
	}
	if o.Progress == nil {
		o.Progress = io.Discard
	}
	if o.TreeMiB < 1 {
		return fmt.Errorf("tree size %d MiB: must be at least 1", o.TreeMiB)
	}
	if o.ChangedPercent <= 0 || o.ChangedPercent > 100 {
		return fmt.Errorf("changed percent %g: must be above 0 and at most 100", o.ChangedPercent)
	}
	for _, tool := range []string{"cp", "tar"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("baseline %s: %w (install coreutils and tar)", tool, err)
		}
	}
	return nil
}

// measureBaselines measures cp -a and tar -cf of scratch/tree, each a
// row of res.
func measureBaselines(ctx context.Context, progress io.Writer, scratch string, res *SnapshotResult) (cp, tar SnapshotRow, err error) {
	fmt.Fprintf(progress, "snapshot: baseline cp -a ...\n")
	if cp, err = measureCommand(ctx, scratch, "copy", "cp -a", "cp", "-a", "tree", "copy"); err != nil {
		return cp, tar, err
	}
	res.Rows = append(res.Rows, cp)
	fmt.Fprintf(progress, "snapshot: baseline tar -cf ...\n")
	if tar, err = measureCommand(ctx, scratch, "copy.tar", "tar -cf", "tar", "-cf", "copy.tar", "tree"); err != nil {
		return cp, tar, err
	}
	res.Rows = append(res.Rows, tar)
	return cp, tar, nil
}

// measureFork restores snapshot id into scratch/fork and measures it.
func measureFork(ctx context.Context, store *cas.Store, scratch, id string) (SnapshotRow, error) {
	if err := atomicfile.SyncFS(scratch); err != nil {
		return SnapshotRow{}, err
	}
	forkDir := filepath.Join(scratch, "fork")
	t0 := time.Now()
	rst, err := store.Restore(ctx, id, forkDir)
	if err != nil {
		return SnapshotRow{}, err
	}
	d := time.Since(t0)
	size, err := treeSize(forkDir)
	if err != nil {
		return SnapshotRow{}, err
	}
	return SnapshotRow{What: "restore (fork)", Duration: d, BytesWritten: rst.Bytes, DirGrowth: size, ReadBytes: rst.ReadBytes}, nil
}

func snapshotRatio(a, b float64) float64 {
	if b <= 0 {
		return 0
	}
	return a / b
}

func measureSnapshot(ctx context.Context, store *cas.Store, storeDir, tree, prev, what string) (SnapshotRow, string, error) {
	if err := atomicfile.SyncFS(storeDir); err != nil {
		return SnapshotRow{}, "", err
	}
	before, err := treeSize(storeDir)
	if err != nil {
		return SnapshotRow{}, "", err
	}
	t0 := time.Now()
	id, st, err := store.Snapshot(ctx, tree, prev)
	d := time.Since(t0)
	if err != nil {
		return SnapshotRow{}, "", fmt.Errorf("%s: %w", what, err)
	}
	after, err := treeSize(storeDir)
	if err != nil {
		return SnapshotRow{}, "", err
	}
	return SnapshotRow{What: what, Duration: d, BytesWritten: st.NewBytes, DirGrowth: after - before,
		ReadBytes: st.ReadBytes, NewBlobs: st.NewBlobs, ReusedFiles: st.ReusedFiles}, id, nil
}

// measureCommand runs a baseline command in dir and measures it and the
// size of out, what it made.
func measureCommand(ctx context.Context, dir, out, what string, argv ...string) (SnapshotRow, error) {
	if err := atomicfile.SyncFS(dir); err != nil {
		return SnapshotRow{}, err
	}
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Dir = dir
	t0 := time.Now()
	b, err := cmd.CombinedOutput()
	d := time.Since(t0)
	if err != nil {
		return SnapshotRow{}, fmt.Errorf("baseline %s: %w: %s", what, err, b)
	}
	size, err := treeSize(filepath.Join(dir, out))
	if err != nil {
		return SnapshotRow{}, err
	}
	return SnapshotRow{What: what, Duration: d, BytesWritten: size, DirGrowth: size}, nil
}

// treeSize is the sum of the sizes of the regular files under p (or p's
// size if it is a file).
func treeSize(p string) (int64, error) {
	var n int64
	err := filepath.WalkDir(p, func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			fi, err := d.Info()
			if err != nil {
				return err
			}
			n += fi.Size()
		}
		return nil
	})
	return n, err
}

type genFile struct {
	path string
	size int64
}

// generateTree writes a deterministic tree of total bytes under root: a few
// thousand files for 200 MiB (most of 512 B to 16 KiB, some of 16 to 256
// KiB, one in a hundred of 1 to 8 MiB) in a few hundred directories
// nested up to four deep, filled with incompressible pseudo-random bytes.
func generateTree(root string, total int64) ([]genFile, int, error) {
	r := rand.New(rand.NewPCG(0x5eed, 1))
	content := rand.NewChaCha8([32]byte{'s', 't', 'a', 's', 'i', 's'})
	dirs := map[string]bool{}
	var files []genFile
	buf := make([]byte, 8<<20)
	var sum int64
	for i := 0; sum < total; i++ {
		var size int64
		switch x := r.Float64(); {
		case x < 0.86:
			size = 512 + r.Int64N(16<<10-512)
		case x < 0.99:
			size = 16<<10 + r.Int64N(240<<10)
		default:
			size = 1<<20 + r.Int64N(7<<20)
		}
		size = min(size, total-sum)
		dir := fmt.Sprintf("pkg%02d", i%23)
		switch {
		case i%11 == 0:
			dir = filepath.Join(dir, "internal", "gen", fmt.Sprintf("x%d", i%3))
		case i%4 != 0:
			dir = filepath.Join(dir, fmt.Sprintf("mod%d", (i/23)%5))
		}
		abs := filepath.Join(root, dir)
		if !dirs[dir] {
			if err := os.MkdirAll(abs, 0o755); err != nil {
				return nil, 0, err
			}
			dirs[dir] = true
		}
		p := filepath.Join(abs, fmt.Sprintf("f%05d.dat", i))
		b := buf[:size]
		_, _ = content.Read(b) // never fails
		if err := os.WriteFile(p, b, 0o644); err != nil {
			return nil, 0, err
		}
		files = append(files, genFile{path: p, size: size})
		sum += size
	}
	levels := map[string]bool{} // every directory level, once
	for d := range dirs {
		for ; d != "."; d = filepath.Dir(d) {
			levels[d] = true
		}
	}
	return files, len(levels), nil
}

// changeTree changes about percent of the tree's bytes, in files picked at
// random (deterministically): every other one is rewritten whole with new
// bytes, the rest grow by a quarter. It returns the files changed and the
// bytes written.
func changeTree(files []genFile, percent float64) (int, int64, error) {
	var total int64
	for _, f := range files {
		total += f.size
	}
	budget := int64(float64(total) * percent / 100)
	r := rand.New(rand.NewPCG(0xc4a96e, 2))
	content := rand.NewChaCha8([32]byte{'c', 'h', 'a', 'n', 'g', 'e'})
	var changed int
	var written int64
	for _, i := range r.Perm(len(files)) {
		if written >= budget {
			break
		}
		f := &files[i]
		rewrite := changed%2 == 0
		n := f.size
		if !rewrite {
			n = max(f.size/4, 1024)
		}
		if written+n > budget+budget/10+1024 {
			continue // too big for what is left; a smaller file will do
		}
		b := make([]byte, n)
		_, _ = content.Read(b)
		if rewrite {
			if err := os.WriteFile(f.path, b, 0o644); err != nil {
				return changed, written, err
			}
		} else {
			fh, err := os.OpenFile(f.path, os.O_APPEND|os.O_WRONLY, 0)
			if err != nil {
				return changed, written, err
			}
			_, werr := fh.Write(b)
			if err := errors.Join(werr, fh.Close()); err != nil {
				return changed, written, err
			}
			f.size += n
		}
		changed++
		written += n
	}
	return changed, written, nil
}
