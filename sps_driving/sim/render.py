"""The forward camera, rendered offscreen by panda3d's software rasterizer (p3tinydisplay).

One Renderer per process, reused across episodes: `render(world)` rebuilds the scene graph only
when the episode changes. No ShowBase: the renderer drives a GraphicsEngine and its own scene
root directly, so nothing global outlives `load`. The camera is a pinhole with the car camera's
130 degree horizontal field of view, square pixels, at the configured mounting pose.

The rasterizer lights per vertex and ignores fog, so ground geometry is subdivided (headlights
light vertices) and rain and snow are drawn in image space, seeded per frame. Opaque geometry is
drawn in scene-graph order and composed transforms are not cached (process-wide settings), so a
frame is a function of the world state alone, whatever the process drew before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cv2
import numpy as np
from panda3d.core import (
    AmbientLight,
    Camera,
    CullBinManager,
    DirectionalLight,
    FrameBufferProperties,
    GraphicsEngine,
    GraphicsOutput,
    GraphicsPipe,
    GraphicsPipeSelection,
    NodePath,
    PerspectiveLens,
    Point2,
    Point3,
    Spotlight,
    Texture,
        WindowProperties,
    loadPrcFileData,
)

from sps_driving.sim.mesh import Mesh
from sps_driving.sim.world import Episode, World, rng_for

# transform-cache off: Panda3D keeps the products of transforms it composed before and hands them
# out again, and the same pose reached through another composition differs in its last bits, so a
# frame came out a grey level apart in a few pixels depending on which episodes the process drew
# before (a worker's episodes come in the pool's order). Without the cache a frame is a function of
# the world state alone; drawing costs the same (2.8 ms a frame either way).
loadPrcFileData(
    "sps_driving.sim",
    "load-display p3tinydisplay\nwindow-type offscreen\naudio-library-name null\nsync-video false\n"
    "notify-level warning\nnotify-level-x11display fatal\nnotify-level-tinydisplay fatal\ntransform-cache false\n",
)

# Colours (linear RGB 0..1) per scene axis. Fields come in several colours per season.
GRASS = {"spring": (0.36, 0.62, 0.25), "summer": (0.22, 0.46, 0.13), "fall": (0.5, 0.45, 0.24), "winter": (0.9, 0.92, 0.96)}
FIELDS = {
    "spring": ((0.42, 0.66, 0.3), (0.55, 0.72, 0.38), (0.45, 0.36, 0.26), (0.62, 0.78, 0.42)),
    "summer": ((0.2, 0.42, 0.11), (0.76, 0.66, 0.3), (0.3, 0.52, 0.17), (0.55, 0.58, 0.22)),
    "fall": ((0.62, 0.48, 0.26), (0.48, 0.33, 0.18), (0.72, 0.6, 0.33), (0.42, 0.38, 0.22)),
    "winter": ((0.93, 0.94, 0.97), (0.86, 0.88, 0.92), (0.95, 0.95, 0.98), (0.82, 0.84, 0.88)),
}
CROWNS = {
    "spring": ((0.45, 0.72, 0.3), (0.52, 0.76, 0.34), (0.95, 0.76, 0.86)),
    "summer": ((0.13, 0.36, 0.1), (0.18, 0.42, 0.12), (0.1, 0.3, 0.08)),
    "fall": ((0.86, 0.45, 0.1), (0.75, 0.2, 0.08), (0.9, 0.74, 0.18)),
    "winter": (),  # deciduous trees are bare
}
CONIFER = (0.08, 0.24, 0.1)
TRUNK = (0.3, 0.2, 0.12)
BUILDINGS = ((0.62, 0.3, 0.22), (0.7, 0.68, 0.62), (0.45, 0.47, 0.52), (0.82, 0.76, 0.6), (0.32, 0.4, 0.5), (0.55, 0.52, 0.5))
SKY = {  # (horizon, zenith)
    ("day", "dry"): ((0.72, 0.83, 0.95), (0.3, 0.5, 0.85)),
    ("day", "rain"): ((0.6, 0.62, 0.65), (0.42, 0.44, 0.48)),
    ("day", "snow"): ((0.86, 0.87, 0.9), (0.7, 0.72, 0.76)),
    ("night", "dry"): ((0.05, 0.06, 0.1), (0.01, 0.01, 0.03)),
    ("night", "rain"): ((0.05, 0.05, 0.07), (0.01, 0.01, 0.02)),
    ("night", "snow"): ((0.08, 0.08, 0.1), (0.02, 0.02, 0.03)),
}
LIGHTING = {  # (ambient, sun) intensities
    ("day", "dry"): (0.45, 0.75),
    ("day", "rain"): (0.5, 0.22),
    ("day", "snow"): (0.62, 0.3),
    ("night", "dry"): (0.05, 0.0),
    ("night", "rain"): (0.04, 0.0),
    ("night", "snow"): (0.06, 0.0),
}
ASPHALT = {"dry": (0.3, 0.3, 0.32), "rain": (0.15, 0.15, 0.17), "snow": (0.42, 0.42, 0.45)}
WHITE_LINE, YELLOW_LINE = (0.92, 0.92, 0.9), (0.92, 0.75, 0.2)
GLASS = (0.12, 0.15, 0.2)
TIRE = (0.05, 0.05, 0.05)
LIT_WINDOW = (1.0, 0.85, 0.5)


class Renderer:
    """Offscreen camera of one size; `render(world)` -> uint8 [H, W, 3] RGB."""

    def __init__(self, config: dict):
        cam = config["camera"]
        self.config = config
        self.width, self.height = int(cam["render_width"]), int(cam["render_height"])
        self.engine = GraphicsEngine.get_global_ptr()
        # Opaque geometry is drawn in scene-graph order, which the scene's build fixes. Panda3D's
        # default sorts it by render state, which orders by the states' memory addresses: two
        # builds of one scene then drew coplanar faces in another order, and the same state gave
        # pixels that differed from one build (one process, one worker) to the next.
        bins = CullBinManager.get_global_ptr()
        bins.set_bin_type(bins.find_bin("opaque"), CullBinManager.BT_unsorted)
        pipe = GraphicsPipeSelection.get_global_ptr().make_module_pipe("p3tinydisplay")
        if pipe is None:
            raise RuntimeError("panda3d's p3tinydisplay software renderer is not available in this panda3d build")
        fb = FrameBufferProperties()
        fb.set_rgb_color(True)
        fb.set_color_bits(24)
        fb.set_depth_bits(16)
        self.buffer = self.engine.make_output(
            pipe, "sps_sim_camera", 0, fb, WindowProperties.size(self.width, self.height), GraphicsPipe.BF_refuse_window
        )
        if self.buffer is None:
            raise RuntimeError("could not open an offscreen panda3d buffer")
        self.texture = Texture()
        self.buffer.add_render_texture(self.texture, GraphicsOutput.RTM_copy_ram)
        self.root = NodePath("sim_root")
        lens = PerspectiveLens()
        hfov = float(cam["hfov_deg"])
        vfov = math.degrees(2.0 * math.atan(math.tan(math.radians(hfov) / 2.0) * self.height / self.width))
        lens.set_fov(hfov, vfov)
        lens.set_near_far(float(cam["near_m"]), float(cam["far_m"]))
        # The rig follows the car (rear axle, yaw); the camera sits on it at the mounting pose.
        self.rig = self.root.attach_new_node("ego_rig")
        camera_node = Camera("camera")
        camera_node.set_lens(lens)
        self.camera = self.rig.attach_new_node(camera_node)
        self.camera.set_pos(0.0, float(cam["mount_forward_m"]), float(cam["mount_height_m"]))
        self.camera.set_p(float(cam["pitch_deg"]))
        self.region = self.buffer.make_display_region()
        self.region.set_camera(self.camera)
        self.region.set_clear_color_active(True)
        self.region.set_clear_depth_active(True)
        self.scene: NodePath | None = None
        self.actor_nodes: list[NodePath] = []
        self.loaded: Episode | None = None

    def close(self) -> None:
        self.engine.remove_window(self.buffer)

    # ---------------------------------------------------------------- per-episode scene
    def load(self, episode: Episode) -> None:
        if self.loaded is episode:
            return
        if self.scene is not None:
            self.scene.remove_node()
        self.root.clear_light()
        for child in self.rig.get_children():
            if child != self.camera:
                child.remove_node()
        self.scene = self.root.attach_new_node("scene")
        sc = episode.scenario
        looks = rng_for(episode.seed, "scenery", episode.scenery or sc.name)
        horizon, zenith = SKY[(sc.time, sc.weather)]
        self.region.set_clear_color((*horizon, 1.0))
        self._sky(horizon, zenith)
        self._lights(sc, looks)
        for chunk in _build_static(self.config, episode, looks):
            chunk.reparent_to(self.scene)
        self.actor_nodes = []
        for spec in episode.actors:
            node = _actor_node(spec.model, spec.color, sc.time == "night", spec.oncoming)
            node.reparent_to(self.scene)
            self.actor_nodes.append(node)
        self.loaded = episode

    def _sky(self, horizon, zenith) -> None:
        """A dome around the camera rig: an unlit vertical gradient behind everything."""
        mesh = Mesh()
        radius = 0.8 * float(self.config["camera"]["far_m"])
        elevation = np.radians(np.array([-20.0, 0.0, 6.0, 20.0, 45.0, 90.0]))
        azimuth = np.linspace(0, 2 * math.pi, 25)
        e, a = np.meshgrid(elevation, azimuth, indexing="ij")
        pts = np.stack([np.cos(e) * np.cos(a), np.cos(e) * np.sin(a), np.sin(e)], -1) * radius
        w = np.clip(np.sin(e) / math.sin(math.radians(45)), 0, 1)[..., None]
        colors = (1 - w) * np.asarray(horizon) + w * np.asarray(zenith)
        mesh.grid(pts, colors)
        dome = mesh.node("sky")
        dome.reparent_to(self.rig)
        dome.set_light_off(1)
        dome.set_two_sided(True)
        dome.set_bin("background", 0)
        dome.set_depth_write(False)
        dome.set_depth_test(False)

    def _lights(self, sc, looks) -> None:
        ambient_level, sun_level = LIGHTING[(sc.time, sc.weather)]
        if sc.time == "night" and sc.scene == "urban":
            ambient_level += 0.06  # street lighting
        ambient = AmbientLight("ambient")
        ambient.set_color((ambient_level, ambient_level, ambient_level * 1.05, 1))
        self.root.set_light(self.scene.attach_new_node(ambient))
        if sun_level > 0:
            sun = DirectionalLight("sun")
            sun.set_color((sun_level, sun_level * 0.97, sun_level * 0.9, 1))
            sun_np = self.scene.attach_new_node(sun)
            sun_np.set_hpr(float(looks.uniform(0, 360)), float(looks.uniform(-60, -30)), 0)
            self.root.set_light(sun_np)
        if sc.time == "night":
            # Per-vertex Lambert lighting from a lamp at bumper height grazes the road and lights
            # almost nothing, so the headlight cone is cast from above the car instead.
            head = Spotlight("headlights")
            head.set_color((2.2, 2.15, 2.0, 1))
            head.get_lens().set_fov(60, 45)
            reach = float(self.config["render"]["headlight_range_m"])
            head.set_attenuation((1.0, 0.0, 1.0 / reach**2))
            head.set_exponent(0.0)  # p3tinydisplay darkens everything for exponents > 0
            lamp = self.rig.attach_new_node(head)
            lamp.set_pos(0, float(self.config["vehicle"]["wheelbase_m"]), 5.0)
            lamp.set_p(-22)
            self.root.set_light(lamp)

    # ---------------------------------------------------------------- per frame
    def _follow(self, world: World) -> None:
        """Put the camera rig on the ego car."""
        st = world.state
        self.rig.set_pos(st.x, st.y, 0.0)
        self.rig.set_h(math.degrees(st.yaw) - 90.0)

    def project(self, world: World, points: np.ndarray) -> np.ndarray:
        """Where world points [n, 3] (x, y, z m) appear in this camera on `world`'s ego car:
        [n, 2] (row, column) as fractions of the frame's height and width (outside [0, 1]: out of
        view); the points must lie in front of the camera."""
        self._follow(world)
        lens = self.camera.node().get_lens()
        film = Point2()
        out = np.empty((len(points), 2))
        for i, point in enumerate(np.asarray(points, dtype=np.float64)):
            in_camera = self.camera.get_relative_point(self.root, Point3(*point))
            if in_camera.y <= 0.0:
                raise ValueError(f"point {tuple(point)} is behind the camera")
            lens.project(in_camera, film)
            out[i] = (1.0 - film.y) / 2.0, (film.x + 1.0) / 2.0
        return out

    def render(self, world: World, frame_index: int | None = None) -> np.ndarray:
        self.load(world.episode)
        self._follow(world)
        poses = {id(p.spec): p for p in world.actor_poses()}
        for spec, node in zip(world.episode.actors, self.actor_nodes):
            pose = poses.get(id(spec))
            if pose is None:
                node.hide()
                continue
            node.show()
            node.set_pos(pose.x, pose.y, 0.0)
            node.set_h(math.degrees(pose.yaw))
        self.engine.render_frame()
        image = np.frombuffer(self.texture.get_ram_image_as("RGB"), dtype=np.uint8)
        image = np.ascontiguousarray(image.reshape(self.height, self.width, 3)[::-1])
        frame = world.steps if frame_index is None else frame_index
        return weather_overlay(image, world.episode, frame, float(self.config["render"]["particles"]),
                               float(self.config["camera"].get("view_width_scale", 1.0)))


_RENDERERS: dict[tuple[int, int], Renderer] = {}


def get_renderer(config: dict) -> Renderer:
    """The process's renderer for the configured size (created on first use)."""
    key = (int(config["camera"]["render_width"]), int(config["camera"]["render_height"]))
    if key not in _RENDERERS:
        for other in list(_RENDERERS.values()):
            other.close()
        _RENDERERS.clear()
        _RENDERERS[key] = Renderer(config)
    renderer = _RENDERERS[key]
    renderer.config = config
    return renderer


def weather_overlay(image: np.ndarray, episode: Episode, frame: int, particles_at_224: float,
                    view_width_scale: float = 1.0) -> np.ndarray:
    """Rain streaks or snowflakes in image space, drawn from a per-frame seed.

    A view `view_width_scale` times as wide (sim.config.widen_view) gets, in its central nominal
    frame, the particles and contrast the nominal frame gets, and particles of its own beside it."""
    weather = episode.scenario.weather
    if weather == "dry":
        return image
    h, w = image.shape[:2]
    nominal = int(round(w / view_width_scale))  # px of the nominal frame, in the middle
    margin = (w - nominal) // 2
    rng = rng_for(episode.seed, "weather", frame)
    count = int(particles_at_224 * (nominal * h) / (224 * 140))
    scale = nominal / 224.0
    out = image.astype(np.float32)
    xs, ys = rng.uniform(0, nominal, count) + margin, rng.uniform(0, h, count)
    lengths = rng.uniform(5, 14, count) * scale if weather == "rain" else None
    large = np.arange(count) < count // 3  # snow: a third of the flakes are larger
    if margin:
        beside = rng_for(episode.seed, "weather beside", frame)
        extra = int(particles_at_224 * ((w - nominal) * h) / (224 * 140))
        extra_xs = beside.uniform(0, w - nominal, extra)
        xs = np.concatenate([xs, np.where(extra_xs < margin, extra_xs, extra_xs + nominal)])
        ys = np.concatenate([ys, beside.uniform(0, h, extra)])
        if lengths is not None:
            lengths = np.concatenate([lengths, beside.uniform(5, 14, extra) * scale])
        large = np.concatenate([large, np.arange(extra) < extra // 3])
    alpha = np.zeros((h, w), np.float32)
    if weather == "rain":
        # Overcast contrast loss plus slanted streaks, all drawn in one call.
        out = 0.75 * out + 0.25 * out[:, margin:margin + nominal].mean()
        streaks = np.stack([np.stack([xs, ys], 1), np.stack([xs - 0.25 * lengths, ys + lengths], 1)], 1)
        cv2.polylines(alpha, list(np.round(streaks).astype(np.int32)), False, 0.45, 1, cv2.LINE_AA)
        color = np.array((200, 205, 215), np.float32)
    else:
        # Flakes: single pixels softened, and a third of them grown into larger flakes.
        out = 0.8 * out + 0.2 * 225.0
        ix, iy = xs.astype(int), ys.astype(int)
        alpha[iy, ix] = 1.0
        big = np.zeros_like(alpha)
        big[iy[large], ix[large]] = 1.0
        size = max(3, int(round(2 * scale)) | 1)
        disc = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (size, size))
        alpha = np.maximum(cv2.GaussianBlur(alpha, (3, 3), 0) * 2.5, cv2.dilate(big, disc))
        alpha = np.clip(alpha, 0.0, 0.9)
        color = np.array((250, 250, 252), np.float32)
    a = alpha[..., None]
    out = out * (1 - a) + color * a
    return np.clip(out, 0, 255).astype(np.uint8)


# ------------------------------------------------------------------------------ static scene
def _noise(rng, shape, amount):
    return 1.0 + rng.uniform(-amount, amount, shape)[..., None]


def _lattice(road, s: np.ndarray, laterals: np.ndarray, heights: np.ndarray) -> np.ndarray:
    pts = road.points(s[:, None], laterals[None, :])
    z = np.broadcast_to(np.asarray(heights, dtype=np.float64)[None, :], pts.shape[:2])
    return np.concatenate([pts, z[..., None]], axis=-1)


def _build_static(config: dict, episode: Episode, rng: np.random.Generator) -> list[NodePath]:
    """Road, markings, roadside and scenery, grouped in chunks along the road so the renderer
    culls everything out of view."""
    road, sc = episode.road, episode.scenario
    chunk_m = float(config["render"]["chunk_m"])
    extent = float(config["render"]["ground_extent_m"])
    half = road.lane_width / 2.0
    right_edge, left_edge = -half - road.shoulder, half + road.lane_width + road.shoulder
    asphalt = np.asarray(ASPHALT[sc.weather])
    night = sc.time == "night"
    if sc.season == "winter":
        asphalt = np.asarray(ASPHALT["snow"])

    field_colors = FIELDS[sc.season]
    # Field bands: lateral boundaries and colours drawn once per side.
    def band_profile():
        edges = [0.0]
        while edges[-1] < extent:
            edges.append(edges[-1] + rng.uniform(8, 25))
        return np.array(edges), [field_colors[int(rng.integers(len(field_colors)))] for _ in edges]

    bands = {side: band_profile() for side in (-1, 1)}
    chunks = []
    n_chunks = int(math.ceil(road.length / chunk_m))
    for ci in range(n_chunks):
        s0, s1 = ci * chunk_m, min((ci + 1) * chunk_m, road.length)
        mesh = Mesh()
        s = np.linspace(s0, s1, max(int(round((s1 - s0) / 2.0)), 1) + 1)
        # Road surface, subdivided at every marking for per-vertex headlights.
        lat = np.array([right_edge, -half, -half / 2, 0.0, half / 2, half, half + road.lane_width / 2, half + road.lane_width, left_edge])
        colors = np.broadcast_to(asphalt, (len(s), len(lat), 3)) * _noise(rng, (len(s), len(lat)), 0.06)
        if sc.season == "winter":
            # Packed snow on the shoulders and along the centre line.
            colors = colors.copy()
            colors[:, [0, -1]] = (0.85, 0.86, 0.9)
        mesh.grid(_lattice(road, s, lat, np.zeros(len(lat))), colors)
        _markings(mesh, road, s0, s1, half, sc)
        if sc.scene == "rural":
            _rural_ground(mesh, road, s, right_edge, left_edge, extent, bands, sc, rng)
        else:
            _urban_ground(mesh, road, s, right_edge, left_edge, extent, sc, rng)
        emissive = Mesh()
        _scenery(_Chunk(mesh, emissive, road, s0, s1, right_edge, left_edge, sc, night, rng))
        node = mesh.node(f"chunk{ci}")
        if not emissive.empty:
            lit = emissive.node("emissive")
            lit.set_light_off(1)
            lit.reparent_to(node)
        chunks.append(node)
    chunks.append(_far_ground(road, sc, rng))
    return chunks


def _markings(mesh: Mesh, road, s0: float, s1: float, half: float, sc) -> None:
    line_w = 0.15
    fade = 0.55 if sc.season == "winter" else 1.0  # worn and snow-covered in winter
    white = np.asarray(WHITE_LINE) * fade + (1 - fade) * np.asarray(ASPHALT["snow"])
    yellow = np.asarray(YELLOW_LINE) * fade + (1 - fade) * np.asarray(ASPHALT["snow"])
    s = np.linspace(s0, s1, max(int(round((s1 - s0) / 2.0)), 1) + 1)
    for center, color in ((-half, white), (half + road.lane_width, white)):
        lat = np.array([center - line_w / 2, center + line_w / 2])
        mesh.grid(_lattice(road, s, lat, np.full(2, 0.02)), np.broadcast_to(color, (len(s), 2, 3)))
    # Dashed centre line: 3 m painted of every 9 m.
    start = math.floor(s0 / 9.0) * 9.0
    while start < s1:
        a, b = max(start, s0), min(start + 3.0, s1)
        if b > a:
            ds = np.array([a, b])
            lat = np.array([half - line_w / 2, half + line_w / 2])
            mesh.grid(_lattice(road, ds, lat, np.full(2, 0.02)), np.broadcast_to(yellow, (2, 2, 3)))
        start += 9.0


def _rural_ground(mesh, road, s, right_edge, left_edge, extent, bands, sc, rng) -> None:
    grass = np.asarray(GRASS[sc.season])
    for side, edge in ((-1, right_edge), (1, left_edge)):
        edges, colors = bands[side]
        offsets = np.concatenate([[0.0, 1.5, 4.0], 4.0 + edges[1:]])
        offsets = offsets[offsets <= extent + 4.0]
        lat = edge + side * offsets
        z = np.where(offsets < 0.1, -0.03, -0.08)
        z[1] = -0.35  # a shallow ditch beside the shoulder
        cols = np.empty((len(s), len(lat), 3))
        cols[:, :3] = grass
        for k in range(3, len(lat)):
            cols[:, k] = colors[min(k - 2, len(colors) - 1)]
        cols *= _noise(rng, (len(s), len(lat)), 0.08)
        order = np.argsort(lat)
        mesh.grid(_lattice(road, s, lat[order], z[order]), cols[:, order])


def _urban_ground(mesh, road, s, right_edge, left_edge, extent, sc, rng) -> None:
    curb, walk = (0.68, 0.68, 0.66), (0.6, 0.6, 0.58)
    lot = (0.42, 0.42, 0.43) if sc.weather != "rain" else (0.3, 0.3, 0.32)
    for side, edge in ((-1, right_edge), (1, left_edge)):
        offsets = np.array([0.0, 0.0, 3.5, 5.0, 12.0, extent])
        z = np.array([0.0, 0.15, 0.15, 0.05, 0.02, 0.02])
        colors = np.array([curb, walk, walk, lot, lot, lot])
        lat = edge + side * offsets
        cols = np.broadcast_to(colors, (len(s), len(lat), 3)) * _noise(rng, (len(s), len(lat)), 0.05)
        order = np.argsort(lat)
        mesh.grid(_lattice(road, s, lat[order], z[order]), cols[:, order])


def _far_ground(road, sc, rng) -> NodePath:
    """A wide plane under everything to the horizon, and hills or a skyline beyond the detail."""
    mesh = Mesh()
    cx, cy = float(road.x.mean()), float(road.y.mean())  # the plane is centred on the road
    size = 1400.0
    g = np.linspace(-size / 2, size / 2, 15)
    gx, gy = np.meshgrid(g + cx, g + cy, indexing="ij")
    pts = np.stack([gx, gy, np.full_like(gx, -0.5)], -1)
    base = np.asarray(GRASS[sc.season] if sc.scene == "rural" else (0.4, 0.4, 0.41))
    mesh.grid(pts, np.broadcast_to(base, pts.shape) * _noise(rng, pts.shape[:2], 0.05))
    placed = 0
    for _ in range(200):
        if placed == 24:
            break
        # Hills (rural) or a skyline (urban) well beyond the modelled roadside, anywhere along the road.
        x, y = road.point(rng.uniform(0, road.length), rng.choice([-1.0, 1.0]) * rng.uniform(150, 320))
        size = rng.uniform(40, 90) if sc.scene == "rural" else rng.uniform(15, 40)
        if not _clear_of_road(road, x, y, size + 90.0):
            continue
        placed += 1
        if sc.scene == "rural":
            color = np.asarray(GRASS[sc.season]) * 0.75 + 0.05
            mesh.blob((x, y, -3.0), (size, rng.uniform(40, 90), rng.uniform(8, 20)), color, rings=2, sides=8)
        else:
            mesh.box((x, y, 20.0), (size, rng.uniform(15, 40), rng.uniform(30, 80)), BUILDINGS[int(rng.integers(len(BUILDINGS)))])
    return mesh.node("far")


def _clear_of_road(road, x: float, y: float, clearance: float) -> bool:
    return float(np.min((road.x - x) ** 2 + (road.y - y) ** 2)) >= clearance**2


@dataclass
class _Chunk:
    """One chunk of road being built: what its scenery is drawn into and where."""

    mesh: Mesh  # lit geometry
    emissive: Mesh  # self-lit geometry (street lamps and windows at night)
    road: object  # sim.road.Road
    s0: float  # start along the road, m
    s1: float  # end along the road, m
    right_edge: float  # lateral offset of the right road edge, m (left positive)
    left_edge: float  # lateral offset of the left road edge, m
    scenario: object  # sim.scenarios.Scenario
    night: bool
    rng: np.random.Generator  # the scene's draws, in build order


def _scenery(chunk: _Chunk) -> None:
    if chunk.scenario.scene == "rural":
        _trees(chunk)
        # Wooden utility poles along the left side.
        for s in np.arange(math.ceil(chunk.s0 / 40.0) * 40.0, chunk.s1, 40.0):
            x, y = chunk.road.point(s, chunk.left_edge + 3.0)
            chunk.mesh.prism((x, y, 0.0), 0.13, 0.11, 8.5, (0.35, 0.26, 0.18), sides=5)
            h = float(chunk.road.heading_at(s))
            chunk.mesh.box((x, y, 8.0), (0.15, 2.2, 0.12), (0.35, 0.26, 0.18), yaw=h)
    else:
        _buildings(chunk)
        for s in np.arange(math.ceil(chunk.s0 / 25.0) * 25.0, chunk.s1, 25.0):
            h = float(chunk.road.heading_at(s))
            for side, edge in ((-1, chunk.right_edge), (1, chunk.left_edge)):
                x, y = chunk.road.point(s, edge + side * 0.6)
                chunk.mesh.prism((x, y, 0.15), 0.1, 0.08, 7.5, (0.25, 0.27, 0.3), sides=5)
                lx, ly = chunk.road.point(s, edge - side * 1.0)
                head = (lx, ly, 7.5)
                lamp = (1.0, 0.92, 0.7) if chunk.night else (0.75, 0.75, 0.7)
                (chunk.emissive if chunk.night else chunk.mesh).box(head, (0.8, 0.35, 0.15), lamp, yaw=h)
        if chunk.scenario.season != "winter":
            for s in np.arange(chunk.s0 + chunk.rng.uniform(0, 12), chunk.s1, 12.0):
                x, y = chunk.road.point(s, chunk.right_edge - 2.4)
                chunk.mesh.prism((x, y, 0.15), 0.12, 0.1, 2.2, TRUNK, sides=5)
                crowns = CROWNS[chunk.scenario.season]
                chunk.mesh.blob((x, y, 3.0), (1.3, 1.3, 1.2), crowns[0] if crowns else TRUNK)


def _trees(chunk: _Chunk) -> None:
    crowns = CROWNS[chunk.scenario.season]
    count = int(chunk.rng.poisson((chunk.s1 - chunk.s0) / 4.0))
    for _ in range(count):
        s = chunk.rng.uniform(chunk.s0, chunk.s1)
        side = -1 if chunk.rng.random() < 0.5 else 1
        edge = chunk.right_edge if side < 0 else chunk.left_edge
        offset = chunk.rng.uniform(7.0, 45.0) if chunk.rng.random() < 0.8 else chunk.rng.uniform(45.0, 70.0)
        x, y = chunk.road.point(s, edge + side * offset)
        if not _clear_of_road(chunk.road, x, y, min(offset, 8.0) + abs(edge)):
            continue
        height = chunk.rng.uniform(5.0, 12.0)
        if chunk.rng.random() < 0.3:
            # Conifer: green all year, snow-dusted in winter.
            color = CONIFER if chunk.scenario.season != "winter" else (0.75, 0.8, 0.82)
            chunk.mesh.prism((x, y, 0.0), 0.2, 0.15, height * 0.25, TRUNK, sides=5)
            shade = chunk.rng.uniform(0.85, 1.1)
            chunk.mesh.prism((x, y, height * 0.2), height * 0.22, 0.0, height * 0.8, np.asarray(color) * shade, sides=7)
        else:
            chunk.mesh.prism((x, y, 0.0), 0.22, 0.15, height * 0.6, TRUNK, sides=5)
            if crowns:
                color = np.asarray(crowns[int(chunk.rng.integers(len(crowns)))]) * chunk.rng.uniform(0.85, 1.1)
                r = height * chunk.rng.uniform(0.25, 0.35)
                chunk.mesh.blob((x, y, height * 0.65), (r, r, r * 0.9), color)
            else:
                for k in range(4):  # bare branches
                    a = k * math.pi / 2 + chunk.rng.uniform(0, 1)
                    branch = (x + 0.8 * math.cos(a), y + 0.8 * math.sin(a), height * 0.65)
                    chunk.mesh.box(branch, (2.0, 0.12, 0.12), TRUNK, yaw=a, pitch=-0.6)
    if chunk.scenario.season in ("summer", "fall"):
        for _ in range(int(chunk.rng.poisson((chunk.s1 - chunk.s0) / 15.0))):  # hay bales in the fields
            s, side = chunk.rng.uniform(chunk.s0, chunk.s1), (-1 if chunk.rng.random() < 0.5 else 1)
            edge = chunk.right_edge if side < 0 else chunk.left_edge
            x, y = chunk.road.point(s, edge + side * chunk.rng.uniform(8.0, 50.0))
            if _clear_of_road(chunk.road, x, y, 7.0):
                chunk.mesh.prism((x, y, 0.0), 0.8, 0.8, 1.2, (0.8, 0.7, 0.38), sides=8)


def _buildings(chunk: _Chunk) -> None:
    for side, edge in ((-1, chunk.right_edge), (1, chunk.left_edge)):
        s = chunk.s0 + chunk.rng.uniform(0.0, 3.0)
        while s < chunk.s1:
            rng = chunk.rng
            frontage, depth, height = rng.uniform(8.0, 22.0), rng.uniform(8.0, 16.0), rng.uniform(6.0, 36.0)
            setback = 5.5 + chunk.rng.uniform(0.0, 2.0)
            mid_s = s + frontage / 2.0
            x, y = chunk.road.point(mid_s, edge + side * (setback + depth / 2.0))
            yaw = float(chunk.road.heading_at(mid_s))
            if _clear_of_road(chunk.road, x, y, abs(edge) + setback + depth / 2.0 - 1.0):
                color = np.asarray(BUILDINGS[int(chunk.rng.integers(len(BUILDINGS)))]) * chunk.rng.uniform(0.85, 1.1)
                chunk.mesh.box((x, y, height / 2.0), (frontage, depth, height), color, yaw=yaw)
                _windows(chunk, mid_s, edge + side * (setback - 0.05), side, frontage, height, yaw)
            s += frontage + chunk.rng.uniform(1.0, 5.0)


def _windows(chunk: _Chunk, s: float, lateral: float, side: int, frontage: float, height: float, yaw: float) -> None:
    """Window panes on the facade that faces the road, drawn two-sided as flat quads."""
    u, z = np.meshgrid(np.arange(-frontage / 2 + 1.5, frontage / 2 - 1.0, 3.0), np.arange(3.0, height - 1.0, 3.5))
    fx, fy = chunk.road.point(s, lateral)
    centers = np.stack([fx + u.ravel() * math.cos(yaw), fy + u.ravel() * math.sin(yaw), z.ravel()], axis=1)
    # Facades on the right of the road face left (+90 deg), those on the left face right.
    facing = yaw if side < 0 else yaw + math.pi
    lit = chunk.rng.random(len(centers)) < (0.35 if chunk.night else 0.0)
    chunk.mesh.quads(centers[~lit], (1.4, 1.6), facing, GLASS)
    chunk.emissive.quads(centers[lit], (1.4, 1.6), facing, LIT_WINDOW)


# ------------------------------------------------------------------------------ actors
def _actor_node(model, color, night: bool, oncoming: bool) -> NodePath:
    """A road actor in its own frame: x forward, y left, z up, origin at the footprint centre."""
    m = Mesh()
    L, W, H = model.length_m, model.width_m, model.height_m
    shape = model.shape
    lamps = Mesh()
    if shape in ("sedan", "suv", "hatchback", "pickup", "van", "boxtruck", "bus"):
        clearance = 0.3 if shape in ("sedan", "hatchback") else 0.4
        body_top = {"sedan": 0.95, "hatchback": 1.0, "suv": 1.15, "pickup": 1.1}.get(shape, H)
        if shape in ("van", "bus"):
            m.box((0, 0, (clearance + H) / 2), (L, W, H - clearance), color)
            band = (H - clearance) * 0.35
            m.box((0.05, 0, H - band * 1.2), (L - 0.6, W + 0.02, band), GLASS)
            m.box((L / 2 - 0.02, 0, H - band * 1.1), (0.1, W - 0.2, band * 1.2), GLASS)
        elif shape == "boxtruck":
            cab = 0.25 * L
            m.box((L / 2 - cab / 2, 0, 1.5), (cab, W - 0.1, 2.2), color)
            m.box((L / 2 - 0.02, 0, 2.0), (0.1, W - 0.3, 0.7), GLASS)
            m.box((-cab / 2, 0, (0.6 + H) / 2), (L - cab - 0.2, W, H - 0.6), (0.92, 0.92, 0.9))
        else:
            m.box((0, 0, (clearance + body_top) / 2), (L, W, body_top - clearance), color)
            cabin_len = {"sedan": 0.5, "hatchback": 0.6, "suv": 0.62, "pickup": 0.38}[shape] * L
            cabin_x = {"sedan": -0.05 * L, "hatchback": -0.18 * L, "suv": -0.1 * L, "pickup": 0.12 * L}[shape]
            m.box((cabin_x, 0, (body_top + H) / 2), (cabin_len, W * 0.9, H - body_top), GLASS)
            m.box((cabin_x, 0, H - 0.04), (cabin_len * 0.92, W * 0.88, 0.08), color)
            if shape == "pickup":
                m.box((-0.25 * L, 0, body_top + 0.01), (0.42 * L, W * 0.85, 0.04), (0.1, 0.1, 0.1))
        for sx in (0.32, -0.32):
            for sy in (1, -1):
                m.box((sx * L, sy * (W / 2 - 0.1), 0.33), (0.66, 0.26, 0.66), TIRE)
        # Tail lights (red) and headlights (white), unlit so they glow at night.
        tail = (1.0, 0.12, 0.1) if night else (0.55, 0.06, 0.05)
        head = (1.0, 1.0, 0.9) if (night and oncoming) else (0.85, 0.85, 0.8)
        for sy in (1, -1):
            lamps.box((-L / 2 - 0.02, sy * (W / 2 - 0.25), 0.85), (0.06, 0.3, 0.15), tail)
            lamps.box((L / 2 + 0.02, sy * (W / 2 - 0.25), 0.75), (0.06, 0.3, 0.15), head)
    else:
        leg = {"deer": 0.85, "cow": 0.75, "moose": 1.15, "dog": 0.4}[shape]
        body_h = H - leg - (0.35 if shape != "dog" else 0.1)
        body_len = L * 0.72
        m.box((-0.05 * L, 0, leg + body_h / 2), (body_len, W, body_h), color)
        for sx in (0.3, -0.3):
            for sy in (1, -1):
                m.box((sx * body_len, sy * W * 0.3, leg / 2), (0.12, 0.12, leg), np.asarray(color) * 0.8)
        neck_x = body_len / 2
        m.box((neck_x, 0, leg + body_h + 0.1), (0.25, W * 0.45, 0.55), color, pitch=-0.5)
        m.box((neck_x + 0.2, 0, H - 0.15), (0.45, W * 0.5, 0.25), np.asarray(color) * 0.9)
        if shape == "cow":
            m.box((-0.1 * L, 0, leg + body_h * 0.6), (0.5, W + 0.02, 0.35), (0.92, 0.9, 0.88))
        if shape == "deer":
            m.box((-body_len / 2 - 0.03, 0, leg + body_h * 0.7), (0.06, 0.2, 0.2), (0.95, 0.93, 0.9))
        if shape == "moose":
            m.box((neck_x + 0.1, 0, H + 0.1), (0.15, 1.2, 0.1), (0.75, 0.68, 0.55))
    body = m.node(model.name)
    if not lamps.empty:
        glow = lamps.node(model.name + "_lamps")
        glow.set_light_off(1)
        glow.reparent_to(body)
    return body
