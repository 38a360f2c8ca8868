package cli

import (
	"fmt"
	"math"

	"github.com/dustin/go-humanize"
	"github.com/spf13/pflag"

	"stasis/internal/providers/local"
	"stasis/sandbox"
)

// limitFlags are the local sandboxes' default limits, as flags; empty
// sizes and zero counts keep local.DefaultLimits.
type limitFlags struct {
	pids, cpuWeight   int
	memory, shm, disk string
}

func (l *limitFlags) add(f *pflag.FlagSet) {
	d := local.DefaultLimits
	f.IntVar(&l.pids, "pids-limit", 0, fmt.Sprintf("local: the most processes and threads a sandbox runs at once (default %d)", d.Pids))
	f.StringVar(&l.memory, "memory-limit", "", fmt.Sprintf("local: the most memory and swap a sandbox uses, e.g. 2GiB (default %s)", humanize.IBytes(uint64(d.MemoryBytes))))
	f.IntVar(&l.cpuWeight, "cpu-weight", 0, fmt.Sprintf("local: a sandbox's share of the CPUs, 1 to 10000 (default %d, an even share)", d.CPUWeight))
	f.StringVar(&l.shm, "shm-size", "", fmt.Sprintf("local: the size of a sandbox's /dev/shm (default %s)", humanize.IBytes(uint64(d.ShmBytes))))
	f.StringVar(&l.disk, "disk-limit", "", fmt.Sprintf("local: the most a sandbox's writable places take on disk (default %s)", humanize.IBytes(uint64(d.DiskBytes))))
}

// parse checks the flags and returns the limits they give.
func (l *limitFlags) parse() (sandbox.Limits, error) {
	out := sandbox.Limits{Pids: l.pids, CPUWeight: l.cpuWeight}
	for _, s := range []struct {
		flag, v string
		to      *int64
	}{{"--memory-limit", l.memory, &out.MemoryBytes}, {"--shm-size", l.shm, &out.ShmBytes}, {"--disk-limit", l.disk, &out.DiskBytes}} {
		if s.v == "" {
			continue
		}
		n, err := humanize.ParseBytes(s.v)
		if err != nil || n == 0 || n > math.MaxInt64 {
			return sandbox.Limits{}, fmt.Errorf("%s %q: give a size such as 512MiB or 4GiB", s.flag, s.v)
		}
		*s.to = int64(n)
	}
	if err := out.Check(); err != nil {
		return sandbox.Limits{}, fmt.Errorf("the limit flags: %w", err)
	}
	return out, nil
}
