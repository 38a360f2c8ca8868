package pyenv

import (
	"bufio"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// dpkgStatus and dpkgInfo are dpkg's database: what is installed, and the
// files of each package.
var (
	dpkgStatus = "/var/lib/dpkg/status"
	dpkgInfo   = "/var/lib/dpkg/info"
)

// dpkgPkg is an installed package.
type dpkgPkg struct {
	name, version, arch string
	deps                [][]string // Depends and Pre-Depends: groups of alternatives
}

// installedPackages reads dpkg's status file: the installed packages by
// name, and the installed providers of each virtual package.
func installedPackages() (map[string]*dpkgPkg, map[string][]string, error) {
	f, err := os.Open(dpkgStatus)
	if err != nil {
		return nil, nil, fmt.Errorf("pyenv: reading dpkg's database: %w", err)
	}
	defer f.Close()
	pkgs := map[string]*dpkgPkg{}
	provides := map[string][]string{}
	fields := map[string]string{}
	last := ""
	flush := func() {
		defer clear(fields)
		st := strings.Fields(fields["Status"])
		if len(st) != 3 || st[2] != "installed" || fields["Package"] == "" {
			return
		}
		p := &dpkgPkg{name: fields["Package"], version: fields["Version"], arch: fields["Architecture"]}
		p.deps = append(parseDeps(fields["Pre-Depends"]), parseDeps(fields["Depends"])...)
		pkgs[p.name] = p
		for _, g := range parseDeps(fields["Provides"]) {
			for _, v := range g {
				provides[v] = append(provides[v], p.name)
			}
		}
	}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "":
			flush()
			last = ""
		case line[0] == ' ' || line[0] == '\t':
			if last != "" {
				fields[last] += " " + strings.TrimSpace(line)
			}
		default:
			k, v, ok := strings.Cut(line, ":")
			if ok {
				last = k
				fields[k] = strings.TrimSpace(v)
			}
		}
	}
	flush()
	if err := sc.Err(); err != nil {
		return nil, nil, fmt.Errorf("pyenv: reading %s: %w", dpkgStatus, err)
	}
	return pkgs, provides, nil
}

// parseDeps parses a Depends-style field into groups of alternatives' names
// (versions, architecture qualifiers and restrictions dropped).
func parseDeps(s string) [][]string {
	var out [][]string
	for _, group := range strings.Split(s, ",") {
		var alts []string
		for _, alt := range strings.Split(group, "|") {
			alt = strings.TrimSpace(alt)
			if i := strings.IndexAny(alt, " ([<"); i >= 0 {
				alt = alt[:i]
			}
			alt, _, _ = strings.Cut(alt, ":")
			if alt != "" {
				alts = append(alts, alt)
			}
		}
		if len(alts) > 0 {
			out = append(out, alts)
		}
	}
	return out
}

// closure returns the installed packages that pkgs need: pkgs and,
// recursively, every installed alternative (or provider) of their
// dependencies, sorted by name.
func closure(pkgs []string, installed map[string]*dpkgPkg, provides map[string][]string) []*dpkgPkg {
	seen := map[string]bool{}
	var out []*dpkgPkg
	var visit func(name string)
	visit = func(name string) {
		if seen[name] {
			return
		}
		seen[name] = true
		p := installed[name]
		if p == nil {
			for _, prov := range provides[name] {
				visit(prov)
			}
			return
		}
		out = append(out, p)
		for _, g := range p.deps {
			for _, alt := range g {
				visit(alt)
			}
		}
	}
	for _, n := range pkgs {
		n, _, _ = strings.Cut(n, ":")
		visit(n)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out
}

// versions lists pkgs as name=version.
func versions(pkgs []*dpkgPkg) []string {
	out := make([]string, len(pkgs))
	for i, p := range pkgs {
		out[i] = p.name + "=" + p.version
	}
	return out
}

// ownedUnder returns the paths under dir (not dir itself) that the
// packages' file lists name.
func ownedUnder(pkgs []*dpkgPkg, dir string) (map[string]bool, error) {
	owned := map[string]bool{}
	for _, p := range pkgs {
		var f *os.File
		var err error
		for _, name := range []string{p.name + ".list", p.name + ":" + p.arch + ".list"} {
			if f, err = os.Open(filepath.Join(dpkgInfo, name)); err == nil {
				break
			}
		}
		if err != nil {
			continue // a package with no files (a metapackage)
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if l := sc.Text(); strings.HasPrefix(l, dir+"/") {
				owned[filepath.Clean(l)] = true
			}
		}
		err = sc.Err()
		f.Close()
		if err != nil {
			return nil, err
		}
	}
	return owned, nil
}

// makeView fills dst with symbolic links to the entries of src that owned
// names: an entry is linked whole when everything in it is owned (its
// byte-code caches aside), else a directory is made and its entries are
// looked at in turn. Python then sees, through dst, the Debian packages of
// one environment and not the others installed on the host.
func makeView(dst, src string, owned map[string]bool) error {
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return err
	}
	ents, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	for _, e := range ents {
		p := filepath.Join(src, e.Name())
		if !owned[p] {
			continue
		}
		if e.IsDir() && !whollyOwned(p, owned) {
			if err := makeView(filepath.Join(dst, e.Name()), p, owned); err != nil {
				return err
			}
			continue
		}
		if err := os.Symlink(p, filepath.Join(dst, e.Name())); err != nil {
			return err
		}
	}
	return nil
}

// whollyOwned reports whether every entry under dir is owned, byte-code
// caches aside.
func whollyOwned(dir string, owned map[string]bool) bool {
	all := true
	_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			all = false
			return fs.SkipAll
		}
		if d.Name() == "__pycache__" && d.IsDir() {
			return fs.SkipDir
		}
		if p != dir && !owned[p] && !strings.HasSuffix(p, ".pyc") {
			all = false
			return fs.SkipAll
		}
		return nil
	})
	return all
}
