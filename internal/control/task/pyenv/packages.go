package pyenv

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os/exec"
	"sort"
	"strings"
)

// builderPackages are what the builder itself needs whatever the request
// names: Debian's Python (and its venv module), and pip, setuptools and
// wheel for the editable install.
var builderPackages = []string{"python3", "python3-venv", "python3-pip", "python3-setuptools", "python3-wheel"}

// pytestSet is the default environment: the builder's packages and pytest.
var pytestSet = append(append([]string{}, builderPackages...), "python3-pytest")

// compiled is what a repository with C, C++ or Cython extensions needs to
// build them in place.
var compiled = []string{"python3-dev", "gcc", "g++", "cython3", "python3-numpy"}

// repoPackages maps a repository ("owner/name", lower case) to the Debian
// bookworm packages of its runtime and test dependencies, beyond pytestSet.
//
// This is an approximation: SWE-bench pins each repository version's pip
// environment (exact versions of numpy, astroid, werkzeug, ...), while here
// every repository gets Debian's one version of each dependency, which can
// be newer or older than the pinned one. flit is the Debian package that
// ships flit_core, the build backend of later seaborn, flask, sphinx,
// marshmallow and pydicom versions. Not packaged in bookworm, so missing
// here: pyvista's scooby, sqlfluff's oyaml, astropy's and django's optional
// extras beyond those listed.
var repoPackages = map[string][]string{
	"astropy/astropy": join(compiled,
		"python3-setuptools-scm", "python3-extension-helpers", "python3-erfa", "python3-yaml",
		"python3-packaging", "python3-scipy", "python3-hypothesis", "python3-pytest-astropy",
		"python3-pytest-doctestplus", "python3-pytest-remotedata", "python3-pytest-openfiles",
		"python3-pytest-arraydiff", "python3-pytest-astropy-header", "python3-pytest-filter-subpackage"),
	"django/django": {
		"python3-asgiref", "python3-sqlparse", "python3-tz", "tzdata", "python3-argon2", "python3-bcrypt",
		"python3-docutils", "python3-jinja2", "python3-numpy", "python3-pil", "python3-yaml",
		"python3-tblib", "python3-pymemcache", "python3-redis", "python3-geoip2", "python3-aiosmtpd"},
	"matplotlib/matplotlib": join(compiled,
		"python3-setuptools-scm", "pkg-config", "libfreetype-dev", "libqhull-dev", "python3-pybind11",
		"python3-cycler", "python3-dateutil", "python3-kiwisolver", "python3-pyparsing", "python3-pil",
		"python3-fonttools", "python3-packaging", "python3-contourpy", "python3-certifi",
		"python3-pytest-xdist", "python3-pytest-rerunfailures", "python3-pytest-timeout", "python3-psutil"),
	"mwaskom/seaborn": {
		"flit", "python3-numpy", "python3-pandas", "python3-matplotlib", "python3-scipy", "python3-statsmodels"},
	"pallets/flask": {
		"flit", "python3-werkzeug", "python3-jinja2", "python3-itsdangerous", "python3-click",
		"python3-blinker", "python3-markupsafe", "python3-asgiref", "python3-dotenv"},
	"psf/requests": {
		"python3-urllib3", "python3-idna", "python3-chardet", "python3-charset-normalizer",
		"python3-certifi", "python3-socks", "python3-pytest-httpbin", "python3-httpbin",
		"python3-pytest-mock", "python3-trustme"},
	"pydata/xarray": {
		"python3-setuptools-scm", "python3-numpy", "python3-pandas", "python3-packaging", "python3-scipy",
		"python3-netcdf4", "python3-h5netcdf", "python3-cftime", "python3-dask", "python3-toolz",
		"python3-bottleneck", "python3-zarr", "python3-pint", "python3-matplotlib", "python3-seaborn",
		"python3-hypothesis"},
	"pylint-dev/pylint": pylint,
	"pycqa/pylint":      pylint,
	"pytest-dev/pytest": {
		"python3-setuptools-scm", "python3-attr", "python3-iniconfig", "python3-pluggy", "python3-py",
		"python3-packaging", "python3-more-itertools", "python3-atomicwrites", "python3-wcwidth",
		"python3-tomli", "python3-hypothesis", "python3-xmlschema", "python3-argcomplete",
		"python3-mock", "python3-nose", "python3-requests", "python3-pygments"},
	"scikit-learn/scikit-learn": join(compiled,
		"python3-scipy", "python3-joblib", "python3-threadpoolctl", "python3-pandas", "python3-matplotlib"),
	"sphinx-doc/sphinx": {
		"flit", "python3-docutils", "python3-jinja2", "python3-pygments", "python3-babel",
		"python3-alabaster", "python3-imagesize", "python3-requests", "python3-snowballstemmer",
		"python3-packaging", "python3-sphinxcontrib.applehelp", "python3-sphinxcontrib.devhelp",
		"python3-sphinxcontrib.htmlhelp", "python3-sphinxcontrib.jsmath", "python3-sphinxcontrib.qthelp",
		"python3-sphinxcontrib.serializinghtml", "python3-html5lib", "python3-defusedxml", "cython3"},
	"sympy/sympy": {"python3-mpmath", "python3-hypothesis"},
	"marshmallow-code/marshmallow": {
		"flit", "python3-dateutil", "python3-simplejson", "python3-tz", "python3-packaging"},
	"sqlfluff/sqlfluff": {
		"python3-click", "python3-colorama", "python3-jinja2", "python3-pathspec", "python3-yaml",
		"python3-regex", "python3-tblib", "python3-tqdm", "python3-typing-extensions", "python3-chardet",
		"python3-appdirs", "python3-toml", "python3-diff-match-patch", "python3-cached-property",
		"diff-cover", "python3-hypothesis"},
	"pvlib/pvlib-python": {
		"python3-setuptools-scm", "python3-numpy", "python3-pandas", "python3-scipy", "python3-tz",
		"python3-requests", "python3-h5py", "python3-pytest-mock", "python3-pytest-timeout",
		"python3-pytest-rerunfailures", "python3-pytest-remotedata", "python3-requests-mock"},
	"pydicom/pydicom":    {"flit", "python3-numpy", "python3-pil"},
	"pylint-dev/astroid": astroid,
	"pycqa/astroid":      astroid,
	"pyvista/pyvista": {
		"python3-numpy", "python3-vtk9", "python3-matplotlib", "python3-pil", "python3-pooch",
		"python3-imageio", "python3-meshio", "python3-appdirs", "python3-scipy"},
}

var pylint = []string{
	"python3-astroid", "python3-isort", "python3-mccabe", "python3-platformdirs", "python3-tomlkit",
	"python3-dill", "python3-typing-extensions", "python3-colorama", "python3-git",
	"python3-pytest-timeout", "python3-pytest-benchmark"}

var astroid = []string{"python3-lazy-object-proxy", "python3-wrapt", "python3-typing-extensions", "python3-six"}

func join(a []string, b ...string) []string { return append(append([]string{}, a...), b...) }

// Packages returns the Debian packages the environment of repo ("owner/name",
// any case) needs: its entry of the table above with the pytest set, or the
// pytest set alone for a repository the table does not know. The list is
// sorted and has no duplicates; the caller may change it.
func Packages(repo string) []string {
	return normalize(append(join(pytestSet), repoPackages[strings.ToLower(strings.TrimSpace(repo))]...))
}

// normalize sorts pkgs and drops duplicates and empty names.
func normalize(pkgs []string) []string {
	out := make([]string, 0, len(pkgs))
	seen := map[string]bool{}
	for _, p := range pkgs {
		p = strings.TrimSpace(p)
		if p == "" || seen[p] {
			continue
		}
		seen[p] = true
		out = append(out, p)
	}
	sort.Strings(out)
	return out
}

// Missing returns those of pkgs that dpkg does not have installed, sorted.
// It fails only when dpkg-query cannot be run at all.
func Missing(pkgs []string) ([]string, error) {
	pkgs = normalize(pkgs)
	if len(pkgs) == 0 {
		return nil, nil
	}
	if _, err := exec.LookPath("dpkg-query"); err != nil {
		return nil, fmt.Errorf("pyenv: dpkg-query is not available (environments are built from Debian's packages): %w", err)
	}
	// One query for all: dpkg-query prints a line for each package it
	// knows, and exits 1 (with a message on stderr) when some are unknown.
	cmd := exec.Command("dpkg-query", append([]string{"-W", "-f=${Package} ${db:Status-Abbrev}\n", "--"}, pkgs...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		return nil, fmt.Errorf("pyenv: dpkg-query: %w", err)
	}
	installed := map[string]bool{}
	sc := bufio.NewScanner(&stdout)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) >= 2 && strings.HasPrefix(f[1], "ii") {
			name, _, _ := strings.Cut(f[0], ":") // an architecture-qualified name
			installed[name] = true
			installed[f[0]] = true
		}
	}
	if err != nil && len(installed) == 0 && !strings.Contains(stderr.String(), "no packages found") {
		return nil, fmt.Errorf("pyenv: dpkg-query: %v: %s", err, strings.TrimSpace(stderr.String()))
	}
	var missing []string
	for _, p := range pkgs {
		name, _, _ := strings.Cut(p, ":")
		if !installed[p] && !installed[name] {
			missing = append(missing, p)
		}
	}
	return missing, nil
}

// installLine is the command that installs pkgs.
func installLine(pkgs []string) string {
	return "apt-get install -y " + strings.Join(pkgs, " ")
}
