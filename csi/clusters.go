package csi

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// cluster is one entry of ceph-csi's clusters config.json (the
// ceph-csi-config ConfigMap), read unchanged:
//
//	[{"clusterID": "...", "monitors": ["host:port", ...], "rbd": {"radosNamespace": "..."}}]
//
// Fields ceph-csi has for other drivers (cephFS, nfs, readAffinity) are
// ignored.
type cluster struct {
	ClusterID string   `json:"clusterID"`
	Monitors  []string `json:"monitors"`
	RBD       struct {
		RadosNamespace string `json:"radosNamespace"`
	} `json:"rbd"`
}

// maxClusterIDLen is ceph-csi's bound (it encodes the ID in volume IDs).
const maxClusterIDLen = 36

// clusters reads the config file on every lookup, as ceph-csi does: a
// ConfigMap update reaches a running plugin without a restart.
type clusters struct{ path string }

func (c clusters) load() ([]cluster, error) {
	b, err := os.ReadFile(c.path)
	if err != nil {
		return nil, fmt.Errorf("clusters config: %w", err)
	}
	var cs []cluster
	if err := json.Unmarshal(b, &cs); err != nil {
		return nil, fmt.Errorf("clusters config %s: %w", c.path, err)
	}
	return cs, nil
}

// errUnknownCluster: the clusterID is not in the config.
type errUnknownCluster struct{ id string }

func (e errUnknownCluster) Error() string {
	return fmt.Sprintf("clusterID %q is not in the clusters config", e.id)
}

// get returns the cluster named id.
func (c clusters) get(id string) (cluster, error) {
	cs, err := c.load()
	if err != nil {
		return cluster{}, err
	}
	for _, cl := range cs {
		if cl.ClusterID == id {
			if len(cl.Monitors) == 0 {
				return cl, fmt.Errorf("clusterID %q has no monitors in the clusters config", id)
			}
			return cl, nil
		}
	}
	return cluster{}, errUnknownCluster{id}
}

// credentials are a Secret's userID and userKey: ceph-csi's key names.
type credentials struct {
	ID, Key string
}

// errNoCredentials: the request's secrets lack userID or userKey.
var errNoCredentials = fmt.Errorf("secrets must have userID and userKey")

func credentialsFrom(secrets map[string]string) (credentials, error) {
	c := credentials{ID: secrets["userID"], Key: secrets["userKey"]}
	if c.ID == "" || c.Key == "" {
		return c, errNoCredentials
	}
	return c, nil
}

// options are the Ceph client options for cl with c. The key travels in
// memory only (and, for maps, over the daemon's 0600 socket); never in
// argv, a log or an error.
func (cl cluster) options(c credentials, osdTimeout time.Duration) ceph.Options {
	return ceph.Options{MonHost: strings.Join(cl.Monitors, ","), ID: c.ID, Key: c.Key,
		OpTimeout: 30 * time.Second, OSDOpTimeout: osdTimeout}
}
