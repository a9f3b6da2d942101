"""Vertex-coloured triangle meshes built with numpy and handed to panda3d in one copy.

Lighting in panda3d's software rasterizer is per vertex, so ground geometry is subdivided
rather than drawn as large cards.
"""

from __future__ import annotations

import math

import numpy as np
from panda3d.core import Geom, GeomNode, GeomTriangles, GeomVertexArrayFormat, GeomVertexData, GeomVertexFormat, InternalName, NodePath

_ARRAY = GeomVertexArrayFormat()
_ARRAY.add_column(InternalName.get_vertex(), 3, Geom.NT_float32, Geom.C_point)
_ARRAY.add_column(InternalName.get_normal(), 3, Geom.NT_float32, Geom.C_normal)
_ARRAY.add_column(InternalName.get_color(), 4, Geom.NT_float32, Geom.C_color)
_FORMAT = GeomVertexFormat.register_format(GeomVertexFormat(_ARRAY))

_BOX_FACES = (  # (normal, four corner signs counter-clockwise seen from outside)
    ((1, 0, 0), ((1, -1, -1), (1, 1, -1), (1, 1, 1), (1, -1, 1))),
    ((-1, 0, 0), ((-1, 1, -1), (-1, -1, -1), (-1, -1, 1), (-1, 1, 1))),
    ((0, 1, 0), ((1, 1, -1), (-1, 1, -1), (-1, 1, 1), (1, 1, 1))),
    ((0, -1, 0), ((-1, -1, -1), (1, -1, -1), (1, -1, 1), (-1, -1, 1))),
    ((0, 0, 1), ((-1, -1, 1), (1, -1, 1), (1, 1, 1), (-1, 1, 1))),
    ((0, 0, -1), ((-1, 1, -1), (1, 1, -1), (1, -1, -1), (-1, -1, -1))),
)


def _rgba(color) -> np.ndarray:
    """RGB or RGBA (any leading shape) -> RGBA clipped to [0, 1]."""
    c = np.asarray(color, dtype=np.float32)
    if c.shape[-1] == 3:
        c = np.concatenate([c, np.ones(c.shape[:-1] + (1,), np.float32)], axis=-1)
    return np.clip(c, 0.0, 1.0)


class Mesh:
    def __init__(self) -> None:
        self._vertices: list[np.ndarray] = []
        self._triangles: list[np.ndarray] = []
        self._count = 0

    @property
    def empty(self) -> bool:
        return self._count == 0

    def add(self, positions: np.ndarray, normals: np.ndarray, colors: np.ndarray, triangles: np.ndarray) -> None:
        positions = np.asarray(positions, dtype=np.float32).reshape(-1, 3)
        n = len(positions)
        normals = np.broadcast_to(np.asarray(normals, dtype=np.float32), (n, 3))
        colors = np.asarray(colors, dtype=np.float32)
        colors = np.broadcast_to(_rgba(colors), (n, 4))
        self._vertices.append(np.concatenate([positions, normals, colors], axis=1))
        self._triangles.append(np.asarray(triangles, dtype=np.uint32).reshape(-1, 3) + self._count)
        self._count += n

    def box(self, center, size, color, yaw: float = 0.0, pitch: float = 0.0) -> None:
        """An oriented box: size (along x, along y, along z) before rotating by pitch then yaw."""
        half = np.asarray(size, dtype=np.float64) / 2.0
        rot = _rotation(yaw, pitch)
        for normal, corners in _BOX_FACES:
            pts = (np.asarray(corners, dtype=np.float64) * half) @ rot.T + center
            self.add(pts, rot @ np.asarray(normal, dtype=np.float64), color, [[0, 1, 2], [0, 2, 3]])

    def prism(self, center, radius_bottom: float, radius_top: float, height: float, color, sides: int = 6) -> None:
        """A vertical frustum (cylinder or cone when radius_top = 0) standing on `center`."""
        a = np.linspace(0.0, 2.0 * math.pi, sides, endpoint=False)
        cx, cy, cz = center
        for i in range(sides):
            j = (i + 1) % sides
            pts = [
                (cx + radius_bottom * math.cos(a[i]), cy + radius_bottom * math.sin(a[i]), cz),
                (cx + radius_bottom * math.cos(a[j]), cy + radius_bottom * math.sin(a[j]), cz),
                (cx + radius_top * math.cos(a[j]), cy + radius_top * math.sin(a[j]), cz + height),
                (cx + radius_top * math.cos(a[i]), cy + radius_top * math.sin(a[i]), cz + height),
            ]
            mid = 0.5 * (a[i] + a[j])
            slope = (radius_bottom - radius_top) / height
            normal = np.array([math.cos(mid), math.sin(mid), slope])
            self.add(pts, normal / np.linalg.norm(normal), color, [[0, 1, 2], [0, 2, 3]])

    def blob(self, center, radii, color, rings: int = 3, sides: int = 6) -> None:
        """A low-polygon ellipsoid (tree crowns, bushes)."""
        theta = np.linspace(0.0, math.pi, rings + 2)
        phi = np.linspace(0.0, 2.0 * math.pi, sides + 1)
        t, p = np.meshgrid(theta, phi, indexing="ij")
        unit = np.stack([np.sin(t) * np.cos(p), np.sin(t) * np.sin(p), np.cos(t)], axis=-1).reshape(-1, 3)
        cols = sides + 1
        tris = []
        for r in range(rings + 1):
            for c in range(sides):
                a, b = r * cols + c, r * cols + c + 1
                tris += [[a, a + cols, b], [b, a + cols, b + cols]]
        self.add(unit * radii + center, unit, color, tris)

    def grid(self, positions: np.ndarray, colors: np.ndarray, normals=(0.0, 0.0, 1.0)) -> None:
        """A [rows, cols, 3] lattice of points as a triangle strip surface."""
        rows, cols = positions.shape[:2]
        r, c = np.meshgrid(np.arange(rows - 1), np.arange(cols - 1), indexing="ij")
        a = (r * cols + c).ravel()
        tris = np.concatenate([np.stack([a, a + cols + 1, a + 1], 1), np.stack([a, a + cols, a + cols + 1], 1)])
        self.add(positions.reshape(-1, 3), normals, colors.reshape(-1, colors.shape[-1]), tris)

    def quads(self, centers: np.ndarray, size: tuple[float, float], yaw: float, color) -> None:
        """Vertical rectangles (width along yaw, height along z) facing the yaw + 90 deg side."""
        centers = np.asarray(centers, dtype=np.float64).reshape(-1, 3)
        if len(centers) == 0:
            return
        u = np.array([math.cos(yaw), math.sin(yaw), 0.0]) * size[0] / 2.0
        v = np.array([0.0, 0.0, size[1] / 2.0])
        corners = np.stack([centers - u - v, centers + u - v, centers + u + v, centers - u + v], axis=1)
        base = 4 * np.arange(len(centers))[:, None]
        tris = np.concatenate([base + (0, 2, 1), base + (0, 3, 2)])
        normal = (-math.sin(yaw), math.cos(yaw), 0.0)
        self.add(corners.reshape(-1, 3), normal, color, tris)

    def node(self, name: str) -> NodePath:
        data = np.ascontiguousarray(np.concatenate(self._vertices), dtype=np.float32)
        tris = np.ascontiguousarray(np.concatenate(self._triangles), dtype=np.uint32)
        vdata = GeomVertexData(name, _FORMAT, Geom.UH_static)
        vdata.unclean_set_num_rows(len(data))
        memoryview(vdata.modify_array(0)).cast("B")[:] = data.tobytes()
        prim = GeomTriangles(Geom.UH_static)
        prim.set_index_type(Geom.NT_uint32)
        handle = prim.modify_vertices()
        handle.unclean_set_num_rows(tris.size)
        memoryview(handle).cast("B")[:] = tris.tobytes()
        geom = Geom(vdata)
        geom.add_primitive(prim)
        node = GeomNode(name)
        node.add_geom(geom)
        return NodePath(node)


def _rotation(yaw: float, pitch: float) -> np.ndarray:
    cy, sy, cp, sp = math.cos(yaw), math.sin(yaw), math.cos(pitch), math.sin(pitch)
    rz = np.array([[cy, -sy, 0], [sy, cy, 0], [0, 0, 1]])
    ry = np.array([[cp, 0, sp], [0, 1, 0], [-sp, 0, cp]])
    return rz @ ry
